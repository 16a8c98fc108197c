-- Insert or update the limits of one key of one tenant of a queue on this shard: settings may hold
-- max_in_flight (events of concurrency_key = key fired and unsettled at once) and max_qps (fires of
-- rate_key = key per second); null: the queue's key_max_in_flight / key_max_qps. Absent keys keep
-- their value (a new row takes the column defaults). Range checks are the table's CHECK constraints.
-- Returns the row. Kept on the tenant's own shard only: the only one that dispatches its keys.
CREATE OR REPLACE FUNCTION qm.set_key(queue_name text, tenant_name text, key_name text, settings jsonb)
RETURNS qm.key_settings
LANGUAGE plpgsql AS $$
DECLARE
    qid integer := qm.override_queue(queue_name, 'key', settings, ARRAY['max_in_flight', 'max_qps']);
    r qm.key_settings;
BEGIN
    INSERT INTO qm.key_settings AS t (queue_id, tenant, key, max_in_flight, max_qps)
    VALUES (qid, tenant_name, key_name, (settings->>'max_in_flight')::integer,
            (settings->>'max_qps')::double precision)
    ON CONFLICT (queue_id, tenant, key) DO UPDATE SET
        max_in_flight = CASE WHEN settings ? 'max_in_flight' THEN (settings->>'max_in_flight')::integer
                             ELSE t.max_in_flight END,
        max_qps       = CASE WHEN settings ? 'max_qps' THEN (settings->>'max_qps')::double precision
                             ELSE t.max_qps END,
        updated_at    = now()
    RETURNING * INTO r;
    RETURN r;
END
$$;
