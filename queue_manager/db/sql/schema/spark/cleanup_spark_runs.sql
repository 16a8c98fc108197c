-- Abandon the staging of every run left staging or staged for longer than `older_than` (a job that
-- died and was never run again). A run whose ledger row is locked (a publish in progress, a prepared
-- transaction waiting for recovery) or whose stage table a task still writes is left for next time.
-- Returns the runs abandoned.
CREATE OR REPLACE FUNCTION qm.cleanup_spark_runs(older_than interval) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    r qm.spark_runs;
    n integer := 0;
BEGIN
    FOR r IN SELECT * FROM qm.spark_runs s
              WHERE s.state IN ('staging', 'staged') AND s.updated_at < clock_timestamp() - older_than
              ORDER BY s.updated_at
                FOR UPDATE SKIP LOCKED LOOP
        BEGIN
            PERFORM set_config('lock_timeout', '1s', true);
            IF r.stage_table IS NOT NULL THEN
                EXECUTE format('DROP TABLE IF EXISTS qm.%I', r.stage_table);
            END IF;
            UPDATE qm.spark_runs s SET state = 'abandoned', stage_table = NULL, updated_at = clock_timestamp()
             WHERE s.run_id = r.run_id AND s.queue = r.queue;
            n := n + 1;
        EXCEPTION WHEN lock_not_available THEN
            NULL;  -- a task of that run still writes its stage table: next time
        END;
    END LOOP;
    RETURN n;
END
$$;
