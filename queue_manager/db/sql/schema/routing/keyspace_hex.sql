-- A tenant's keyspace id: the 16 hex digits that shard ranges compare against (docs/design.md,
-- "Shards and the keyspace"; queue_manager/domain/routing.py).
CREATE OR REPLACE FUNCTION qm.keyspace_hex(tenant text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN substr(md5(tenant), 1, 16);
