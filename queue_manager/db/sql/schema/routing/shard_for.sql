-- The shard that owns a tenant, from the topology stored on this shard (NULL if unknown): the
-- right shard named in a misrouted tenant's error.
CREATE OR REPLACE FUNCTION qm.shard_for(tenant text) RETURNS text
LANGUAGE sql STABLE STRICT
BEGIN ATOMIC
    SELECT m.name FROM qm.shard_map m
     WHERE (m.range_start = '' OR qm.keyspace_hex(tenant) COLLATE "C" >= m.range_start)
       AND (m.range_end = '' OR qm.keyspace_hex(tenant) COLLATE "C" < m.range_end)
     LIMIT 1;
END;
