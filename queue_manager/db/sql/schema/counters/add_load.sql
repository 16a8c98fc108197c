-- Bump the enqueue counters after a bulk load that chose its partitions itself (the Python bulk
-- producer, qm.publish_run, qm events retry). The enqueue lock of each partition first, shared to
-- the end of the caller's transaction, as the route trigger takes it per row (qm.route_source).
CREATE OR REPLACE FUNCTION qm.add_load(queue_name text, partitions integer[], counts integer[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
BEGIN
    SELECT * INTO q FROM qm.queues WHERE name = queue_name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" does not exist on this shard', queue_name USING ERRCODE = '42P01';
    END IF;
    PERFORM pg_advisory_xact_lock_shared(qm.lock_class('enqueue'), q.id * 64 + b.bucket)
       FROM (SELECT DISTINCT part % 64 AS bucket FROM unnest(partitions) AS u(part)
              WHERE part >= 0 AND part < cardinality(q.enq_seqs)) b;
    PERFORM nextval(q.enq_seqs[p.part + 1])
       FROM unnest(partitions, counts) AS p(part, cnt), generate_series(1, p.cnt)
      WHERE p.part >= 0 AND p.part < cardinality(q.enq_seqs);
END
$$;
