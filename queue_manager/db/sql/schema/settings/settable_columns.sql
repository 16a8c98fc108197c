-- The settings a client may pass to create_queue / alter_queue: columns of qm.queues, written by
-- qm.write_settings.
CREATE OR REPLACE FUNCTION qm.settable_columns() RETURNS text[]
LANGUAGE sql IMMUTABLE
RETURN ARRAY['partitions', 'shuffle', 'window_seconds', 'cache_size', 'ack_timeout_seconds',
             'backoff_min_seconds', 'backoff_max_seconds', 'max_attempts', 'max_qps', 'max_concurrency',
             'retention_seconds', 'failed_retention_seconds', 'payload_limit_bytes', 'max_delay_seconds',
             'paused', 'tenant_max_in_flight', 'default_priority', 'priority_aging_seconds', 'key_max_in_flight',
             'key_max_qps'];
