-- The rule every new row must pass first, as an expression over a row variable (%1$s, filled in
-- by format()): a fresh event, to_be_fired with attempts 0 and no fire, ack or deadline.
CREATE OR REPLACE FUNCTION qm.rule_fresh() RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN '%1$s.state = ''to_be_fired'' AND %1$s.attempts = 0 AND %1$s.fired_at IS NULL '
       'AND %1$s.acked_at IS NULL AND %1$s.ack_deadline IS NULL';
