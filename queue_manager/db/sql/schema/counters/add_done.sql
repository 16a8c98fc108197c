-- Count events that left the queue (acked, dead-lettered, settled by SQL) in their partitions'
-- done sequences; `parts` holds one entry per event. The done counters live in sequences only: a
-- count is an update in place, without a row version, a dead tuple or a row lock (one row per
-- queue updated per ack batch piled up dead versions under a held snapshot, and every ack walked
-- them). Like every counter here it is not transactional: a statement that fails after it leaves a
-- drift, which the reconciliation removes.
-- The queue's load lock, held to the end of the caller's transaction, orders this read-then-set
-- against a reconciliation slice of any manager process: the slice counts the live events and sets
-- the counter either wholly before this statement's events left (it saw them live, and this adds
-- them) or wholly after its commit (it did not see them, and sets the counter from the enqueue
-- count). One lock per statement: a slice holds it for one partition's count, a few milliseconds.
CREATE OR REPLACE FUNCTION qm.add_done(queue_id integer, parts smallint[]) RETURNS void
LANGUAGE sql AS $$
    SELECT pg_advisory_xact_lock(qm.lock_class('load'), add_done.queue_id) WHERE cardinality(parts) > 0;
    SELECT setval(q.done_seqs[c.p + 1], coalesce(pg_sequence_last_value(q.done_seqs[c.p + 1]), 0) + c.n)
      FROM qm.queues q,
           (SELECT u.p, count(*) AS n FROM unnest(parts) AS u(p) GROUP BY u.p) c
     WHERE q.id = add_done.queue_id AND c.p >= 0 AND c.p < cardinality(q.done_seqs);
$$;
