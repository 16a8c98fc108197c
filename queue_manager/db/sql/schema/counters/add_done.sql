-- Count events that left the queue (acked, dead-lettered, settled by SQL) in their partitions'
-- done sequences; `parts` holds one entry per event. The done counters live in sequences only: a
-- count is an update in place, without a row version, a dead tuple or a row lock (one row per
-- queue updated per ack batch piled up dead versions under a held snapshot, and every ack walked
-- them). Like every counter here it is not transactional: a statement that fails after it leaves a
-- drift, which the next reconciliation of the partition removes.
-- One nextval per event, not a read of the counter and a setval: each nextval is atomic, so a
-- reconciliation slice's setval (qm.reconcile_partition) and the acks beside it never overwrite
-- each other's work; a read-then-set could put back a whole drift the slice had just removed. No
-- lock: the load is approximate by design (docs/design.md, "Shuffle sharding").
CREATE OR REPLACE FUNCTION qm.add_done(queue_id integer, parts smallint[]) RETURNS void
LANGUAGE sql AS $$
    SELECT count(nextval(q.done_seqs[u.p + 1]))
      FROM qm.queues q, unnest(parts) AS u(p)
     WHERE q.id = add_done.queue_id AND u.p >= 0 AND u.p < cardinality(q.done_seqs);
$$;
