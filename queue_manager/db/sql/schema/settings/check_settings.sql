-- Validate a settings object against the registry's columns; returns it unchanged.
CREATE OR REPLACE FUNCTION qm.check_settings(settings jsonb) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    key text;
BEGIN
    IF settings IS NULL OR jsonb_typeof(settings) <> 'object' THEN
        RAISE EXCEPTION 'queue settings must be a JSON object, got %', coalesce(jsonb_typeof(settings), 'NULL')
            USING ERRCODE = '22023';
    END IF;
    FOR key IN SELECT jsonb_object_keys(settings) LOOP
        IF NOT key = ANY (qm.settable_columns()) THEN
            RAISE EXCEPTION 'unknown queue setting "%"; known settings: %', key, array_to_string(qm.settable_columns(), ', ')
                USING ERRCODE = '22023';
        END IF;
    END LOOP;
    RETURN settings;
END
$$;
