-- Approximate load of each partition (index p+1 for partition p): enqueued minus done, as the
-- routing trigger sees it (both from sequences).
CREATE OR REPLACE FUNCTION qm.partition_loads(queue_name text) RETURNS bigint[]
LANGUAGE sql STABLE STRICT
BEGIN ATOMIC
    SELECT array_agg(coalesce(pg_sequence_last_value(s.seq), 0) - coalesce(pg_sequence_last_value(s.dseq), 0) ORDER BY s.ord)
      FROM qm.queues q
     CROSS JOIN LATERAL unnest(q.enq_seqs, q.done_seqs) WITH ORDINALITY AS s(seq, dseq, ord)
     WHERE q.name = queue_name;
END;
