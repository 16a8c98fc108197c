-- Make this database the target shard this_shard of a reshard, owning [range_start, range_end),
-- not serving yet ('pending'), with shards (the topology in force, JSON as for qm.set_topology) as
-- its stored map, so that its errors name the shard serving a tenant now. A database that already
-- serves as a shard, or is the pending target of another name, is refused. Idempotent.
CREATE OR REPLACE FUNCTION qm.reshard_prepare_target(this_shard text, range_start text, range_end text, shards jsonb)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    s qm.shard;
    qid integer;
BEGIN
    SELECT * INTO s FROM qm.shard;
    IF FOUND AND (s.serving <> 'pending' OR s.name <> this_shard) THEN
        RAISE EXCEPTION 'this database is already shard "%" (%): a reshard target must be a new database', s.name, s.serving
            USING ERRCODE = '55000';
    END IF;
    INSERT INTO qm.shard (name, range_start, range_end, serving)
    VALUES (this_shard, reshard_prepare_target.range_start, reshard_prepare_target.range_end, 'pending')
    ON CONFLICT (singleton) DO UPDATE
       SET range_start = excluded.range_start, range_end = excluded.range_end, updated_at = now();
    PERFORM qm.set_shard_map(shards);
    FOR qid IN SELECT id FROM qm.queues ORDER BY id LOOP
        PERFORM qm.apply_queue(qid);
    END LOOP;
    -- a manager started early on the target waits as a standby: no lease while pending. The leader
    -- row last, as in qm.set_serving (the lock order of docs/operations.md)
    UPDATE qm.leader l SET term = l.term + 1, holder = 'reshard', holder_pid = NULL, expires_at = clock_timestamp()
     WHERE l.holder IS DISTINCT FROM 'reshard';
END
$$;
