-- Count what Spark's tasks wrote into the run's stage table and mark the run staged. Returns one
-- row per reason (NULL: the good rows): the distinct rows (by row key) and all the rows written (a
-- retried or speculative task writes its rows again; the publish keeps one per row key).
CREATE OR REPLACE FUNCTION qm.staged_run(run text, queue_name text)
RETURNS TABLE (reason text, distinct_rows bigint, written_rows bigint)
LANGUAGE plpgsql AS $$
DECLARE
    r qm.spark_runs;
    c record;
    good bigint := 0;
    bad bigint := 0;
    written bigint := 0;
BEGIN
    SELECT * INTO r FROM qm.spark_runs s WHERE s.run_id = run AND s.queue = queue_name FOR UPDATE;
    IF NOT FOUND OR r.state NOT IN ('staging', 'staged') THEN
        RAISE EXCEPTION 'Spark run % of queue "%" is not being staged on this shard (state %)',
            quote_literal(run), queue_name, coalesce(r.state, 'none') USING ERRCODE = '55000';
    END IF;
    FOR c IN EXECUTE format('SELECT s.reason AS why, count(DISTINCT s.row_key) AS d, count(*) AS w '
                            'FROM qm.%I s GROUP BY s.reason ORDER BY s.reason NULLS FIRST', r.stage_table) LOOP
        reason := c.why;
        distinct_rows := c.d;
        written_rows := c.w;
        RETURN NEXT;
        written := written + c.w;
        IF c.why IS NULL THEN
            good := c.d;
        ELSE
            bad := bad + c.d;
        END IF;
    END LOOP;
    UPDATE qm.spark_runs s
       SET state = 'staged', staged_rows = written, good_rows = good, rejected_rows = bad,
           duplicate_rows = written - good - bad, updated_at = clock_timestamp()
     WHERE s.run_id = run AND s.queue = queue_name;
END
$$;
