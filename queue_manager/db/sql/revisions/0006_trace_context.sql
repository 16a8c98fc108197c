-- Revision 0006_trace_context: the W3C trace context of each event (docs/observability.md, "Traces").
--
-- Three nullable columns on every queue table, written by producers (the Python helpers from the
-- current span, SQL producers and the Spark loader by name) and carried to the receiver in the
-- delivery frame: traceparent (W3C Trace Context, version 00 form), tracestate and baggage (W3C
-- Baggage), each checked by a named CHECK constraint, so a malformed value is refused with an error
-- naming its column. NULL (no context) costs nothing: no storage, no check. New queues get the same
-- columns and constraints from qm.create_queue.
-- The constraints are added NOT VALID and validated afterwards: the columns are new and NULL, and
-- VALIDATE takes a lock that lets producers and the manager go on while it scans.
DO $$
DECLARE
    q record;
BEGIN
    FOR q IN SELECT name FROM qm.queues ORDER BY id LOOP
        EXECUTE format(
            'ALTER TABLE public.%1$I
                ADD COLUMN traceparent text,
                ADD COLUMN tracestate text,
                ADD COLUMN baggage text,
                ADD CONSTRAINT %2$I CHECK (traceparent ~ %5$L) NOT VALID,
                ADD CONSTRAINT %3$I CHECK (length(tracestate) <= 512 AND tracestate ~ %6$L) NOT VALID,
                ADD CONSTRAINT %4$I CHECK (length(baggage) <= 8192 AND baggage ~ %6$L) NOT VALID',
            q.name, q.name || '_traceparent_w3c', q.name || '_tracestate_w3c', q.name || '_baggage_w3c',
            '^(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$', '^[ -~]*$');
        EXECUTE format('ALTER TABLE public.%1$I VALIDATE CONSTRAINT %2$I, VALIDATE CONSTRAINT %3$I, VALIDATE CONSTRAINT %4$I',
                       q.name, q.name || '_traceparent_w3c', q.name || '_tracestate_w3c', q.name || '_baggage_w3c');
        EXECUTE format('COMMENT ON TABLE public.%I IS %L', q.name,
                       'qm queue; INSERT INTO ' || q.name || ' (tenant, payload[, fire_at, dedup_key, traceparent, tracestate, baggage])');
    END LOOP;
END
$$;
