-- Undo 0009_priorities_keys: the priority and key columns leave every queue table, the due index is
-- (partition, fire_at) again, the registry loses the settings and qm.key_settings goes, with the
-- functions of the schema source that only this revision's code has. Run `qm migrate` with the
-- code of revision 0008_schedules_cancel afterwards: it applies that code's functions.
DO $$
DECLARE
    q record;
BEGIN
    FOR q IN SELECT name FROM qm.queues ORDER BY id LOOP
        EXECUTE format('DROP INDEX public.%I', q.name || '_due');
        -- names priority among its columns (UPDATE OF); the code of 0006 makes it again
        EXECUTE format('DROP TRIGGER IF EXISTS qm_rescheduled ON public.%I', q.name);
        EXECUTE format('ALTER TABLE public.%I DROP COLUMN IF EXISTS priority, DROP COLUMN IF EXISTS concurrency_key,
                        DROP COLUMN IF EXISTS rate_key', q.name);
        EXECUTE format('CREATE INDEX %I ON public.%I (partition, fire_at) WHERE state = ''to_be_fired''',
                       q.name || '_due', q.name);
        EXECUTE format('COMMENT ON TABLE public.%I IS %L', q.name,
                       'qm queue; INSERT INTO ' || q.name || ' (tenant, payload[, fire_at, dedup_key, traceparent, tracestate, baggage])');
    END LOOP;
END
$$;
DROP FUNCTION IF EXISTS qm.set_key(text, text, text, jsonb);
DROP TABLE qm.key_settings;
DROP FUNCTION IF EXISTS qm.unset_key(text, text, text);
DROP FUNCTION IF EXISTS qm.override_queue(text, text, jsonb, text[]);
DROP FUNCTION IF EXISTS qm.rule_keys();
DROP FUNCTION IF EXISTS qm.refuse_keys(text, smallint, text, text);
DROP FUNCTION IF EXISTS qm.apply_queue_default(qm.queues);
ALTER TABLE qm.queues DROP COLUMN default_priority, DROP COLUMN priority_aging_seconds,
    DROP COLUMN key_max_in_flight, DROP COLUMN key_max_qps;
