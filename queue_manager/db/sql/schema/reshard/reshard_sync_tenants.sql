-- Make this shard's tenant overrides of queue_name for the tenants of [range_start, range_end) (the
-- part of an origin shard's range that this shard owns, in a reshard) equal to those of rows, that
-- origin's overrides ({tenant, weight, max_in_flight} each; overrides of tenants outside the range
-- are left out): the ones gone there go, the others are written. Returns the rows written.
CREATE OR REPLACE FUNCTION qm.reshard_sync_tenants(queue_name text, range_start text, range_end text, rows jsonb)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    qid integer;
    n integer;
BEGIN
    qid := (qm.queue_named(queue_name)).id;
    DELETE FROM qm.tenant_settings ts
     WHERE ts.queue_id = qid
       AND (range_start = '' OR qm.keyspace_hex(ts.tenant) COLLATE "C" >= range_start)
       AND (range_end = '' OR qm.keyspace_hex(ts.tenant) COLLATE "C" < range_end)
       AND ts.tenant NOT IN (SELECT e->>'tenant' FROM jsonb_array_elements(rows) e);
    INSERT INTO qm.tenant_settings AS ts (queue_id, tenant, weight, max_in_flight)
    SELECT qid, e->>'tenant', (e->>'weight')::double precision, (e->>'max_in_flight')::integer
      FROM jsonb_array_elements(rows) e
     WHERE (range_start = '' OR qm.keyspace_hex(e->>'tenant') COLLATE "C" >= range_start)
       AND (range_end = '' OR qm.keyspace_hex(e->>'tenant') COLLATE "C" < range_end)
    ON CONFLICT (queue_id, tenant) DO UPDATE
       SET weight = excluded.weight, max_in_flight = excluded.max_in_flight, updated_at = now()
     WHERE (ts.weight, ts.max_in_flight) IS DISTINCT FROM (excluded.weight, excluded.max_in_flight);
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;
