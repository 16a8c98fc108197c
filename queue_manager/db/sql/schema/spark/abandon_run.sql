-- Give up a run's staging on this shard (its rows were rejected, or it is abandoned): the stage table
-- is dropped and the run marked abandoned; a later run with the same id stages again. Returns false
-- when there was nothing to abandon (no such run, or published).
CREATE OR REPLACE FUNCTION qm.abandon_run(run text, queue_name text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    r qm.spark_runs;
BEGIN
    SELECT * INTO r FROM qm.spark_runs s WHERE s.run_id = run AND s.queue = queue_name FOR UPDATE;
    IF NOT FOUND OR r.state NOT IN ('staging', 'staged') THEN
        RETURN false;
    END IF;
    IF r.stage_table IS NOT NULL THEN
        EXECUTE format('DROP TABLE IF EXISTS qm.%I', r.stage_table);
    END IF;
    UPDATE qm.spark_runs s SET state = 'abandoned', stage_table = NULL, updated_at = clock_timestamp()
     WHERE s.run_id = run AND s.queue = queue_name;
    RETURN true;
END
$$;
