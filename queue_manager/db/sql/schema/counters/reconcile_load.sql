-- The whole queue's reconciliation (tests, benchmarks, an operator): it waits for the ack
-- statements in progress, and raises lock_not_available (55P03) without changing a counter while a
-- transaction that enqueued into the queue is open: call it again once it ended (waiting for the
-- enqueue locks could deadlock with a producer that holds one partition's and waits for another's).
-- Under those locks each partition is reconciled as a slice does it (qm.reconcile_partition takes
-- them again, which the same transaction always can); returns the live events per partition.
CREATE OR REPLACE FUNCTION qm.reconcile_load(queue_name text) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
    held integer;
    live bigint[];
BEGIN
    SELECT * INTO q FROM qm.queues WHERE name = queue_name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" does not exist on this shard', queue_name USING ERRCODE = '42P01';
    END IF;
    PERFORM pg_advisory_xact_lock(qm.lock_class('load'), q.id);
    SELECT min(p) INTO held FROM generate_series(0, least(q.partitions_physical, 64) - 1) p
     WHERE NOT pg_try_advisory_xact_lock(qm.lock_class('enqueue'), q.id * 64 + p);
    IF held IS NOT NULL THEN
        RAISE EXCEPTION 'a transaction that enqueued into partition % of queue "%" (or one that shares its lock) is still open', held, queue_name
            USING ERRCODE = '55P03', HINT = 'call qm.reconcile_load again once it ended';
    END IF;
    SELECT array_agg((qm.reconcile_partition(queue_name, p))[2] ORDER BY p) INTO live
      FROM generate_series(0, q.partitions_physical - 1) p;
    RETURN live;
END
$$;
