-- Bump the enqueue counters after a bulk load that chose its partitions itself (the Python bulk
-- producer, qm.publish_run, qm events retry): one nextval per event, as the route trigger does per
-- row. Not transactional: a load that rolls back leaves its bumps until the next reconciliation.
CREATE OR REPLACE FUNCTION qm.add_load(queue_name text, partitions integer[], counts integer[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
BEGIN
    q := qm.queue_named(queue_name);
    PERFORM nextval(q.enq_seqs[p.part + 1])
       FROM unnest(partitions, counts) AS p(part, cnt), generate_series(1, p.cnt)
      WHERE p.part >= 0 AND p.part < cardinality(q.enq_seqs);
END
$$;
