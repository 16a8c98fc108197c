-- Refuse a row whose priority or keys break qm.rule_keys, naming the column: the error's constraint
-- name is <queue>_priority_in_range, <queue>_concurrency_key_valid or <queue>_rate_key_valid
-- (SQLSTATE 23514, as a CHECK constraint would report it), which queue_manager.db.errors.translate
-- turns into an InvalidEventError. Returns nothing when they are well-formed (the generated triggers
-- call it for a row that broke some rule, before qm.refuse_event, which names the other faults).
CREATE OR REPLACE FUNCTION qm.refuse_keys(queue_name text, priority smallint, concurrency_key text, rate_key text)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF priority IS NULL OR priority NOT BETWEEN 1 AND 5 THEN
        RAISE EXCEPTION 'queue "%": priority must be 1 (highest) to 5, got % (rule %_priority_in_range)',
            queue_name, coalesce(priority::text, 'NULL'), queue_name
            USING ERRCODE = '23514', CONSTRAINT = queue_name || '_priority_in_range',
                  HINT = 'leave priority out for the queue''s default_priority';
    END IF;
    IF concurrency_key IS NOT NULL AND (concurrency_key = '' OR length(concurrency_key) > 256) THEN
        RAISE EXCEPTION 'queue "%": concurrency_key must be NULL or 1 to 256 characters, got % characters (rule %_concurrency_key_valid)',
            queue_name, length(concurrency_key), queue_name
            USING ERRCODE = '23514', CONSTRAINT = queue_name || '_concurrency_key_valid';
    END IF;
    IF rate_key IS NOT NULL AND (rate_key = '' OR length(rate_key) > 256) THEN
        RAISE EXCEPTION 'queue "%": rate_key must be NULL or 1 to 256 characters, got % characters (rule %_rate_key_valid)',
            queue_name, length(rate_key), queue_name
            USING ERRCODE = '23514', CONSTRAINT = queue_name || '_rate_key_valid';
    END IF;
END
$$;
