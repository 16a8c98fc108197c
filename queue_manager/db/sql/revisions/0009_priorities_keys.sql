-- Revision 0009_priorities_keys: priorities with aging, and concurrency and rate limits per key
-- (docs/design.md, "Priorities" and "Limits per key").
--
-- Every queue table gets three columns, written by producers (the INSERT, the Python helpers, the
-- Spark loader) and checked on insert by the queue's generated triggers with the other rules
-- (qm.rule_keys, qm.refuse_keys):
--   priority         1 (highest) to 5; the column's default is the queue's default_priority (set by
--                    qm.apply_queue_default), 3 for the rows enqueued before this revision;
--   concurrency_key  NULL or a key of the tenant: at most key_max_in_flight events of one
--                    (tenant, key) fired and unsettled at once;
--   rate_key         NULL or a key of the tenant: at most key_max_qps events of one (tenant, key)
--                    fired per second.
-- The due index gains priority between partition and fire_at, so that a pick reads each partition's
-- levels in fire_at order, each from its own floor, and stops at its quota.
-- The registry gets the queue's settings, and qm.key_settings the overrides of one tenant's key
-- (on the tenant's shard, as qm.tenant_settings).
ALTER TABLE qm.queues
    ADD COLUMN default_priority smallint NOT NULL DEFAULT 3 CHECK (default_priority BETWEEN 1 AND 5),
    ADD COLUMN priority_aging_seconds double precision DEFAULT 30
        CHECK (priority_aging_seconds IS NULL OR priority_aging_seconds > 0),
    ADD COLUMN key_max_in_flight integer CHECK (key_max_in_flight IS NULL OR key_max_in_flight > 0),
    ADD COLUMN key_max_qps double precision CHECK (key_max_qps IS NULL OR key_max_qps > 0);

COMMENT ON COLUMN qm.queues.priority_aging_seconds IS
    'an event waiting this long counts one priority level higher, per interval; NULL: no aging';

-- overrides for one key of one tenant of one queue: max_in_flight (its events fired and unsettled
-- at once, as concurrency_key; NULL = the queue's key_max_in_flight) and max_qps (its fires per
-- second, as rate_key; NULL = the queue's key_max_qps). Kept on the tenant's own shard only.
CREATE TABLE qm.key_settings (
    queue_id      integer NOT NULL REFERENCES qm.queues (id) ON DELETE CASCADE,
    tenant        text NOT NULL CHECK (tenant <> ''),
    key           text NOT NULL CHECK (key <> '' AND length(key) <= 256),
    max_in_flight integer CHECK (max_in_flight IS NULL OR max_in_flight > 0),
    max_qps       double precision CHECK (max_qps IS NULL OR max_qps > 0),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue_id, tenant, key)
);

COMMENT ON TABLE qm.key_settings IS 'per-key limits of a tenant of a queue: max_in_flight, max_qps';

DO $$
DECLARE
    q record;
BEGIN
    FOR q IN SELECT name FROM qm.queues ORDER BY id LOOP
        EXECUTE format('ALTER TABLE public.%I ADD COLUMN priority smallint NOT NULL DEFAULT 3,
                        ADD COLUMN concurrency_key text, ADD COLUMN rate_key text', q.name);
        EXECUTE format('DROP INDEX public.%I', q.name || '_due');
        EXECUTE format('CREATE INDEX %I ON public.%I (partition, priority, fire_at) WHERE state = ''to_be_fired''',
                       q.name || '_due', q.name);
        EXECUTE format('COMMENT ON TABLE public.%I IS %L', q.name,
                       'qm queue; INSERT INTO ' || q.name || ' (tenant, payload[, fire_at, dedup_key, traceparent, '
                       || 'tracestate, baggage, priority, concurrency_key, rate_key])');
    END LOOP;
END
$$;
