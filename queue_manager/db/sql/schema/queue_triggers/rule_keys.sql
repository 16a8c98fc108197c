-- The rule on a new row's priority and keys (docs/sql.md), as an expression over a row variable
-- (%1$s, filled in by format()): a priority from 1 (highest) to 5, and a concurrency_key and a
-- rate_key each NULL or a non-empty text of at most 256 characters. Part of qm.rule_valid, so the
-- generated triggers test it with the other rules; qm.refuse_keys names the fault.
CREATE OR REPLACE FUNCTION qm.rule_keys() RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN '%1$s.priority BETWEEN 1 AND 5 '
       'AND (%1$s.concurrency_key IS NULL OR (%1$s.concurrency_key <> '''' AND length(%1$s.concurrency_key) <= 256)) '
       'AND (%1$s.rate_key IS NULL OR (%1$s.rate_key <> '''' AND length(%1$s.rate_key) <= 256))';
