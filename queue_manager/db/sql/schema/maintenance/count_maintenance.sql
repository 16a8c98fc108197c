-- Count a slice of a maintenance job: `what` is recruited, finished or aborted (n slices, nextval:
-- no lock), or events (what the slices handled: deleted, corrected, moved; a read-then-set under
-- the job's maintenance lock held to the end of the caller's transaction, so that concurrent
-- slices of several managers add up). Counts are in sequences: an update in place, without a row
-- version, a dead tuple or a row lock, and not transactional: an aborted slice stays recruited.
CREATE OR REPLACE FUNCTION qm.count_maintenance(job text, what text, n bigint DEFAULT 1) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    seq regclass;
BEGIN
    IF job IS NULL OR NOT job = ANY (qm.maintenance_jobs())
       OR what IS NULL OR NOT what = ANY (ARRAY['recruited', 'finished', 'aborted', 'events']) THEN
        RAISE EXCEPTION 'no maintenance counter %.%: jobs are %, counters recruited, finished, aborted, events',
            quote_nullable(job), quote_nullable(what), array_to_string(qm.maintenance_jobs(), ', ')
            USING ERRCODE = '22023';
    END IF;
    IF n IS NULL OR n <= 0 THEN
        RETURN;
    END IF;
    seq := format('qm.%I', 'maint_' || job || '_' || what)::regclass;
    IF what = 'events' THEN
        PERFORM pg_advisory_xact_lock(qm.lock_class('maintenance'), array_position(qm.maintenance_jobs(), job));
        PERFORM setval(seq, coalesce(pg_sequence_last_value(seq), 0) + n);
    ELSE
        PERFORM nextval(seq) FROM generate_series(1, n);
    END IF;
END
$$;
