-- Refuse a row whose trace context breaks qm.rule_trace, naming the column: the error's constraint
-- name is <queue>_<column>_w3c (SQLSTATE 23514, as a CHECK constraint would report it), which
-- queue_manager.db.errors.translate turns into an InvalidEventError that says the expected form.
-- Returns nothing when the context is well-formed (the generated triggers call it for a row that
-- broke some rule, before qm.refuse_event, which names the other faults).
CREATE OR REPLACE FUNCTION qm.refuse_trace(queue_name text, traceparent text, tracestate text, baggage text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    bad text;
    expected text;
BEGIN
    -- the forms of qm.rule_trace, one column at a time
    IF traceparent IS NOT NULL AND traceparent !~ '^(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$' THEN
        bad := 'traceparent';
        expected := 'W3C traceparent, version 00 form: 00-<32 lowercase hex, not all 0>-<16 lowercase hex, not all 0>-<2 hex>';
    ELSIF tracestate IS NOT NULL AND (length(tracestate) > 512 OR tracestate !~ '^[ -~]*$') THEN
        bad := 'tracestate';
        expected := 'printable ASCII, at most 512 characters';
    ELSIF baggage IS NOT NULL AND (length(baggage) > 8192 OR baggage !~ '^[ -~]*$') THEN
        bad := 'baggage';
        expected := 'printable ASCII, at most 8192 characters';
    ELSE
        RETURN;
    END IF;
    RAISE EXCEPTION 'queue "%": % is malformed: expected % (rule %_%_w3c)', queue_name, bad, expected, queue_name, bad
        USING ERRCODE = '23514', CONSTRAINT = queue_name || '_' || bad || '_w3c';
END
$$;
