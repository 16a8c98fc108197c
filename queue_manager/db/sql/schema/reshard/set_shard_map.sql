-- Replace the stored topology (qm.shard_map, which names the right shard in errors) with shards,
-- the JSON array of qm.set_topology, without touching this shard's identity or its queues' code.
CREATE OR REPLACE FUNCTION qm.set_shard_map(shards jsonb) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF shards IS NULL OR jsonb_typeof(shards) <> 'array' THEN
        RAISE EXCEPTION 'shards must be a JSON array of {name, range_start, range_end}' USING ERRCODE = '22023';
    END IF;
    DELETE FROM qm.shard_map;
    INSERT INTO qm.shard_map (name, range_start, range_end)
    SELECT e->>'name', e->>'range_start', e->>'range_end' FROM jsonb_array_elements(shards) e;
END
$$;
