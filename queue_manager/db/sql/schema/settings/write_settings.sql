-- Write the given settings over a registry row (absent keys keep their value; for a new row,
-- the column defaults). Range checks are the table's CHECK constraints. The settings that may be
-- NULL (no limit) are set to NULL by a JSON null; the others keep their value.
CREATE OR REPLACE FUNCTION qm.write_settings(queue_id integer, settings jsonb) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM qm.check_settings(settings);
    UPDATE qm.queues SET
        partitions          = coalesce((settings->>'partitions')::integer, partitions),
        partitions_physical = greatest(coalesce((settings->>'partitions')::integer, partitions), partitions_physical),
        shuffle             = coalesce((settings->>'shuffle')::integer, shuffle),
        window_seconds      = coalesce((settings->>'window_seconds')::double precision, window_seconds),
        cache_size          = coalesce((settings->>'cache_size')::integer, cache_size),
        ack_timeout_seconds = coalesce((settings->>'ack_timeout_seconds')::double precision, ack_timeout_seconds),
        backoff_min_seconds = coalesce((settings->>'backoff_min_seconds')::double precision, backoff_min_seconds),
        backoff_max_seconds = coalesce((settings->>'backoff_max_seconds')::double precision, backoff_max_seconds),
        max_attempts        = coalesce((settings->>'max_attempts')::integer, max_attempts),
        max_qps             = CASE WHEN settings ? 'max_qps' THEN (settings->>'max_qps')::double precision ELSE max_qps END,
        max_concurrency     = CASE WHEN settings ? 'max_concurrency' THEN (settings->>'max_concurrency')::integer ELSE max_concurrency END,
        retention_seconds   = coalesce((settings->>'retention_seconds')::double precision, retention_seconds),
        failed_retention_seconds = CASE WHEN settings ? 'failed_retention_seconds'
                                        THEN (settings->>'failed_retention_seconds')::double precision
                                        ELSE failed_retention_seconds END,
        payload_limit_bytes = coalesce((settings->>'payload_limit_bytes')::integer, payload_limit_bytes),
        max_delay_seconds   = coalesce((settings->>'max_delay_seconds')::double precision, max_delay_seconds),
        paused              = coalesce((settings->>'paused')::boolean, paused),
        tenant_max_in_flight = CASE WHEN settings ? 'tenant_max_in_flight'
                                    THEN (settings->>'tenant_max_in_flight')::integer ELSE tenant_max_in_flight END,
        default_priority    = coalesce((settings->>'default_priority')::smallint, default_priority),
        priority_aging_seconds = CASE WHEN settings ? 'priority_aging_seconds'
                                      THEN (settings->>'priority_aging_seconds')::double precision
                                      ELSE priority_aging_seconds END,
        key_max_in_flight   = CASE WHEN settings ? 'key_max_in_flight'
                                   THEN (settings->>'key_max_in_flight')::integer ELSE key_max_in_flight END,
        key_max_qps         = CASE WHEN settings ? 'key_max_qps'
                                   THEN (settings->>'key_max_qps')::double precision ELSE key_max_qps END,
        updated_at          = now()
    WHERE id = queue_id;
END
$$;
