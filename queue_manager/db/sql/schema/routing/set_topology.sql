-- Record this shard's identity and the whole topology, then re-derive every queue's constraints
-- (the shard's range is written into each queue's generated checks).
CREATE OR REPLACE FUNCTION qm.set_topology(this_shard text, shards jsonb) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    me jsonb;
    qid integer;
BEGIN
    SELECT e INTO me FROM jsonb_array_elements(shards) e WHERE e->>'name' = this_shard;
    IF me IS NULL THEN
        RAISE EXCEPTION 'shard "%" is not in the topology given', this_shard USING ERRCODE = '22023';
    END IF;
    DELETE FROM qm.shard_map;
    INSERT INTO qm.shard_map (name, range_start, range_end)
    SELECT e->>'name', e->>'range_start', e->>'range_end' FROM jsonb_array_elements(shards) e;
    INSERT INTO qm.shard (name, range_start, range_end) VALUES (this_shard, me->>'range_start', me->>'range_end')
    ON CONFLICT (singleton) DO UPDATE
       SET name = excluded.name, range_start = excluded.range_start, range_end = excluded.range_end, updated_at = now();
    FOR qid IN SELECT id FROM qm.queues LOOP
        PERFORM qm.apply_queue(qid);
    END LOOP;
END
$$;
