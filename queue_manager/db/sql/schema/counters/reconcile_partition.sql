-- One partition's reconciliation: afterwards load(part) = its live events (to_be_fired + fired).
-- Returns {load before, live events}. Raises lock_not_available (55P03) at once, without waiting
-- and without changing the counter, when an ack statement holds the queue's load lock or a
-- transaction that enqueued into the partition is still open: the slice is aborted, not retried,
-- and a later slice does the partition. The count reads one partition of the <queue>_due index
-- and the <queue>_fired index (no acked row).
-- Why it is then exact (docs/design.md, "Shuffle sharding"): it takes the partition's enqueue lock
-- (L), counts the live events (a snapshot taken after L) and reads the enqueue counter (E), all
-- under the lock. A producer's bump in E was made under its shared lock. It cannot have taken that
-- lock after L (the slice holds it exclusively until after E), so it took it before L; the slice's
-- try succeeded, so the producer had released it, which a transaction does after its commit became
-- visible: the count sees its row.
CREATE OR REPLACE FUNCTION qm.reconcile_partition(queue_name text, part integer) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
    live bigint;
    enq bigint;
    done bigint;
BEGIN
    SELECT * INTO q FROM qm.queues WHERE name = queue_name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" does not exist on this shard', queue_name USING ERRCODE = '42P01';
    END IF;
    IF part IS NULL OR part < 0 OR part >= q.partitions_physical THEN
        RAISE EXCEPTION 'queue "%" has no partition % (it has %)', queue_name, part, q.partitions_physical
            USING ERRCODE = '22023';
    END IF;
    IF NOT pg_try_advisory_xact_lock(qm.lock_class('load'), q.id) THEN
        RAISE EXCEPTION 'the load counters of queue "%" are being written', queue_name
            USING ERRCODE = '55P03', HINT = 'a maintenance slice gives up here; a later one does the partition';
    END IF;
    IF NOT pg_try_advisory_xact_lock(qm.lock_class('enqueue'), q.id * 64 + part % 64) THEN
        RAISE EXCEPTION 'a transaction that enqueued into partition % of queue "%" (or one that shares its lock) is still open', part, queue_name
            USING ERRCODE = '55P03', HINT = 'a maintenance slice gives up here; a later one does the partition';
    END IF;
    EXECUTE format('SELECT (SELECT count(*) FROM public.%1$I WHERE partition = $1 AND state = ''to_be_fired'') '
                   '     + (SELECT count(*) FROM public.%1$I WHERE partition = $1 AND state = ''fired'')', q.name)
        INTO live USING part;
    enq := coalesce(pg_sequence_last_value(q.enq_seqs[part + 1]), 0);
    done := coalesce(pg_sequence_last_value(q.done_seqs[part + 1]), 0);
    PERFORM setval(q.done_seqs[part + 1], enq - live);
    RETURN ARRAY[enq - done, live];
END
$$;
