-- Undo 0006_trace_context: the trace context columns (and their constraints) leave every queue table.
DO $$
DECLARE
    q record;
BEGIN
    FOR q IN SELECT name FROM qm.queues ORDER BY id LOOP
        EXECUTE format('ALTER TABLE public.%I DROP COLUMN IF EXISTS traceparent, DROP COLUMN IF EXISTS tracestate,
                        DROP COLUMN IF EXISTS baggage', q.name);
        EXECUTE format('COMMENT ON TABLE public.%I IS %L', q.name,
                       'qm queue; INSERT INTO ' || q.name || ' (tenant, payload[, fire_at, dedup_key])');
    END LOOP;
END
$$;
