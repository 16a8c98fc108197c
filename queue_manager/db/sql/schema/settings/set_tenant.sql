-- Insert or update one tenant's overrides of a queue on this shard: settings may hold weight and
-- max_in_flight (null: the queue's tenant_max_in_flight); absent keys keep their value (a new row
-- takes the column defaults). Range checks are the table's CHECK constraints. Returns the row.
-- Kept on the tenant's own shard only: the only one that dispatches it.
CREATE OR REPLACE FUNCTION qm.set_tenant(queue_name text, tenant_name text, settings jsonb) RETURNS qm.tenant_settings
LANGUAGE plpgsql AS $$
DECLARE
    qid integer := qm.override_queue(queue_name, 'tenant', settings, ARRAY['weight', 'max_in_flight']);
    r qm.tenant_settings;
BEGIN
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
