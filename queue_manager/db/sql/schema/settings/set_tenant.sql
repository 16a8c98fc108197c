-- Insert or update one tenant's overrides of a queue on this shard: settings may hold weight and
-- max_in_flight (null: the queue's tenant_max_in_flight); absent keys keep their value (a new row
-- takes the column defaults). Range checks are the table's CHECK constraints. Returns the row.
-- Kept on the tenant's own shard only: the only one that dispatches it.
CREATE OR REPLACE FUNCTION qm.set_tenant(queue_name text, tenant_name text, settings jsonb) RETURNS qm.tenant_settings
LANGUAGE plpgsql AS $$
DECLARE
    qid integer;
    key text;
    r qm.tenant_settings;
BEGIN
    SELECT id INTO qid FROM qm.queues WHERE name = queue_name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" does not exist on this shard', queue_name USING ERRCODE = '42P01';
    END IF;
    IF settings IS NULL OR jsonb_typeof(settings) <> 'object' THEN
        RAISE EXCEPTION 'tenant settings must be a JSON object, got %', coalesce(jsonb_typeof(settings), 'NULL')
            USING ERRCODE = '22023';
    END IF;
    FOR key IN SELECT jsonb_object_keys(settings) LOOP
        IF key NOT IN ('weight', 'max_in_flight') THEN
            RAISE EXCEPTION 'unknown tenant setting "%"; known settings: weight, max_in_flight', key
                USING ERRCODE = '22023';
        END IF;
    END LOOP;
    INSERT INTO qm.tenant_settings AS t (queue_id, tenant, weight, max_in_flight)
    VALUES (qid, tenant_name, coalesce((settings->>'weight')::double precision, 1),
            (settings->>'max_in_flight')::integer)
    ON CONFLICT (queue_id, tenant) DO UPDATE SET
        weight        = coalesce((settings->>'weight')::double precision, t.weight),
        max_in_flight = CASE WHEN settings ? 'max_in_flight' THEN (settings->>'max_in_flight')::integer
                             ELSE t.max_in_flight END,
        updated_at    = now()
    RETURNING * INTO r;
    RETURN r;
END
$$;
