-- Revision 0006_trace_context: the W3C trace context of each event (docs/observability.md, "Traces").
--
-- Three nullable columns on every queue table, written by producers (the Python helpers from the
-- current span, SQL producers and the Spark loader by name) and carried to the receiver in the
-- delivery frame: traceparent (W3C Trace Context, version 00 form), tracestate and baggage (W3C
-- Baggage). The queue's generated triggers check them on insert with the other rules
-- (qm.rule_trace, qm.refuse_trace: a malformed value is refused with an error naming its column).
-- NULL (no context) costs no storage. New queues get the same columns from qm.create_queue.
DO $$
DECLARE
    q record;
BEGIN
    FOR q IN SELECT name FROM qm.queues ORDER BY id LOOP
        EXECUTE format('ALTER TABLE public.%I ADD COLUMN traceparent text, ADD COLUMN tracestate text,
                        ADD COLUMN baggage text', q.name);
        EXECUTE format('COMMENT ON TABLE public.%I IS %L', q.name,
                       'qm queue; INSERT INTO ' || q.name || ' (tenant, payload[, fire_at, dedup_key, traceparent, tracestate, baggage])');
    END LOOP;
END
$$;
