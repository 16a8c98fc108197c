-- The id of the queue whose overrides qm.set_tenant or qm.set_key writes, once their settings are
-- known to be a JSON object of known names only (what: 'tenant' or 'key', for the messages; known:
-- the names the caller takes). Refuses a queue that does not exist on this shard (42P01) and
-- anything else in settings (22023).
CREATE OR REPLACE FUNCTION qm.override_queue(queue_name text, what text, settings jsonb, known text[])
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    qid integer;
    name text;
BEGIN
    qid := (qm.queue_named(queue_name)).id;
    IF settings IS NULL OR jsonb_typeof(settings) <> 'object' THEN
        RAISE EXCEPTION '% settings must be a JSON object, got %', what, coalesce(jsonb_typeof(settings), 'NULL')
            USING ERRCODE = '22023';
    END IF;
    FOR name IN SELECT jsonb_object_keys(settings) LOOP
        IF name <> ALL(known) THEN
            RAISE EXCEPTION 'unknown % setting "%"; known settings: %', what, name, array_to_string(known, ', ')
                USING ERRCODE = '22023';
        END IF;
    END LOOP;
    RETURN qid;
END
$$;
