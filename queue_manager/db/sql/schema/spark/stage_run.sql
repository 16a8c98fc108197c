-- Begin, or resume, the staging of (run, queue) on this shard. Returns the ledger row: state
-- 'published' (nothing to do), 'staged' (the rows are all there: publish them) or 'staging' with
-- a new, empty stage table for Spark's tasks to write. An earlier attempt's partial staging is
-- dropped first: its tasks' rows may be incomplete.
CREATE OR REPLACE FUNCTION qm.stage_run(run text, queue_name text) RETURNS qm.spark_runs
LANGUAGE plpgsql AS $$
DECLARE
    r qm.spark_runs;
    t text;
BEGIN
    PERFORM qm.queue_named(queue_name);
    INSERT INTO qm.spark_runs (run_id, queue, state) VALUES (run, queue_name, 'staging') ON CONFLICT DO NOTHING;
    SELECT * INTO STRICT r FROM qm.spark_runs WHERE run_id = run AND queue = queue_name FOR UPDATE;
    IF r.state IN ('published', 'staged') THEN
        RETURN r;
    END IF;
    IF r.stage_table IS NOT NULL THEN
        EXECUTE format('DROP TABLE IF EXISTS qm.%I', r.stage_table);
    END IF;
    t := 'spark_stage_' || nextval('qm.spark_stage_seq');
    -- no index, no constraint: the tasks only append, and a retried task may append its rows again
    EXECUTE format($ddl$CREATE UNLOGGED TABLE qm.%I (
        row_key    bigint NOT NULL,
        tenant     text,
        partition  smallint,
        payload    text,
        fire_at_us bigint,
        dedup_key  text,
        reason     text,
        -- the row's W3C trace context (NULL: none)
        traceparent text,
        tracestate  text,
        baggage     text,
        -- the row's priority (NULL: the queue's default_priority) and keys (NULL: none)
        priority    smallint,
        concurrency_key text,
        rate_key    text
    ) WITH (autovacuum_enabled = off)$ddl$, t);
    EXECUTE format('COMMENT ON TABLE qm.%I IS %L', t, format('staging of Spark run %s into queue %s', run, queue_name));
    UPDATE qm.spark_runs
       SET state = 'staging', stage_table = t, staged_rows = NULL, good_rows = NULL, rejected_rows = NULL,
           duplicate_rows = NULL, updated_at = clock_timestamp()
     WHERE run_id = run AND queue = queue_name
    RETURNING * INTO r;
    RETURN r;
END
$$;
