-- The whole queue's reconciliation (tests, benchmarks, an operator): every partition as a slice
-- does it (qm.reconcile_partition), one after the other, without a lock; returns the live events
-- per partition. Once nothing is in flight (no open enqueue, no settle the manager has still to
-- count), every load equals its live events afterwards.
CREATE OR REPLACE FUNCTION qm.reconcile_load(queue_name text) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
    live bigint[];
BEGIN
    q := qm.queue_named(queue_name);
    SELECT array_agg((qm.reconcile_partition(queue_name, p))[2] ORDER BY p) INTO live
      FROM generate_series(0, q.partitions_physical - 1) p;
    RETURN live;
END
$$;
