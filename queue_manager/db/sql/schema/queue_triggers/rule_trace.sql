-- The rule on a new row's W3C trace context (docs/observability.md, "Where the context lives"), as
-- an expression over a row variable (%1$s, filled in by format()): each of traceparent, tracestate
-- and baggage NULL or well-formed. traceparent in the version 00 form (lowercase hex, trace and
-- parent ids not all zero, version not ff); tracestate and baggage printable ASCII of at most 512
-- and 8 192 characters. Part of qm.rule_valid, so the generated triggers test it with the other
-- rules; a NULL context costs three IS NULL tests. qm.refuse_trace names the fault.
CREATE OR REPLACE FUNCTION qm.rule_trace() RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN '(%1$s.traceparent IS NULL OR %1$s.traceparent ~ ''^(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$'') '
       'AND (%1$s.tracestate IS NULL OR (length(%1$s.tracestate) <= 512 AND %1$s.tracestate ~ ''^[ -~]*$'')) '
       'AND (%1$s.baggage IS NULL OR (length(%1$s.baggage) <= 8192 AND %1$s.baggage ~ ''^[ -~]*$''))';
