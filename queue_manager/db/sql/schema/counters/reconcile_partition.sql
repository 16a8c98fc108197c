-- One partition's reconciliation: re-anchors load(part) on its live events (to_be_fired + fired)
-- and returns {load before, live events}. It takes no lock and waits for nothing: producers and
-- acks go on beside it. The count reads one partition of the <queue>_due index and the
-- <queue>_fired index (no acked row).
-- The enqueue counter (enq) and the done counter (d0) are read just before the count's snapshot,
-- and the events counted done while it ran (d1 - d0, acks beside it) are kept in the anchor, not
-- overwritten. So the anchor misjudges only what is in flight at that instant: an insert that
-- bumped enq but had not committed (the load one too low), an event that had left the live events
-- but was not counted done yet, or the reverse (one off either way); docs/design.md, "Shuffle
-- sharding", states the bound.
CREATE OR REPLACE FUNCTION qm.reconcile_partition(queue_name text, part integer) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
    live bigint;
    enq bigint;
    d0 bigint;
    d1 bigint;
BEGIN
    q := qm.queue_named(queue_name);
    IF part IS NULL OR part < 0 OR part >= q.partitions_physical THEN
        RAISE EXCEPTION 'queue "%" has no partition % (it has %)', queue_name, part, q.partitions_physical
            USING ERRCODE = '22023';
    END IF;
    enq := coalesce(pg_sequence_last_value(q.enq_seqs[part + 1]), 0);
    d0 := coalesce(pg_sequence_last_value(q.done_seqs[part + 1]), 0);
    EXECUTE format('SELECT (SELECT count(*) FROM public.%1$I WHERE partition = $1 AND state = ''to_be_fired'') '
                   '     + (SELECT count(*) FROM public.%1$I WHERE partition = $1 AND state = ''fired'')', q.name)
        INTO live USING part;
    d1 := coalesce(pg_sequence_last_value(q.done_seqs[part + 1]), 0);
    PERFORM setval(q.done_seqs[part + 1], enq - live + (d1 - d0));
    RETURN ARRAY[enq - d0, live];
END
$$;
