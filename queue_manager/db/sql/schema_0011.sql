-- Revision 0011_tenant_settings: per-tenant dispatch settings.
--
--   qm.queues.tenant_max_in_flight  the queue's default cap on one tenant's events in flight (per
--                        shard, like max_concurrency); NULL = no cap. A settable queue setting.
--   qm.tenant_settings   overrides for one tenant of one queue: weight (its share of fires among
--                        backlogged tenants, default 1) and max_in_flight (its own cap; NULL = the
--                        queue's default). Kept on the tenant's own shard only (see qm.set_tenant).
--   qm.set_tenant()      insert or update a tenant's overrides (absent keys keep their value)
--   qm.unset_tenant()    drop a tenant's overrides
--   qm.settable_columns(), qm.write_settings()  the same as revision 0009's, plus tenant_max_in_flight
--
-- The manager reads qm.tenant_settings with the queue settings (on every settings reload).

ALTER TABLE qm.queues
    ADD COLUMN tenant_max_in_flight integer CHECK (tenant_max_in_flight IS NULL OR tenant_max_in_flight > 0);

CREATE TABLE qm.tenant_settings (
    queue_id      integer NOT NULL REFERENCES qm.queues (id) ON DELETE CASCADE,
    tenant        text NOT NULL CHECK (tenant <> ''),
    weight        double precision NOT NULL DEFAULT 1 CHECK (weight > 0 AND weight <= 1000),
    max_in_flight integer CHECK (max_in_flight IS NULL OR max_in_flight > 0),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue_id, tenant)
);

COMMENT ON TABLE qm.tenant_settings IS 'per-tenant dispatch overrides of a queue: weight (default 1), max_in_flight';

CREATE OR REPLACE FUNCTION qm.settable_columns() RETURNS text[]
LANGUAGE sql IMMUTABLE
RETURN ARRAY['partitions', 'shuffle', 'window_seconds', 'cache_size', 'ack_timeout_seconds',
             'backoff_min_seconds', 'backoff_max_seconds', 'max_attempts', 'max_qps', 'max_concurrency',
             'retention_seconds', 'failed_retention_seconds', 'payload_limit_bytes', 'max_delay_seconds',
             'paused', 'tenant_max_in_flight'];

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
        updated_at          = now()
    WHERE id = queue_id;
END
$$;

-- Insert or update one tenant's overrides of a queue on this shard: settings may hold weight and
-- max_in_flight (null: the queue's tenant_max_in_flight); absent keys keep their value (a new row
-- takes the column defaults). Range checks are the table's CHECK constraints. Returns the row.
CREATE FUNCTION qm.set_tenant(queue_name text, tenant_name text, settings jsonb) RETURNS qm.tenant_settings
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

-- Drop one tenant's overrides of a queue on this shard; true when there were some.
CREATE FUNCTION qm.unset_tenant(queue_name text, tenant_name text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    qid integer;
BEGIN
    SELECT id INTO qid FROM qm.queues WHERE name = queue_name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" does not exist on this shard', queue_name USING ERRCODE = '42P01';
    END IF;
    DELETE FROM qm.tenant_settings WHERE queue_id = qid AND tenant = tenant_name;
    RETURN FOUND;
END
$$;

-- Settings notices (revision 0010) for every setting, this revision's included: the UPDATE
-- trigger compares the whole row but the counters' bookkeeping, so that a setting added later
-- needs no new trigger. And a tenant override changed by qm.set_tenant / qm.unset_tenant (or by
-- hand) reaches the manager at once, as a queue setting does.
DROP TRIGGER qm_settings_updated ON qm.queues;
CREATE TRIGGER qm_settings_updated AFTER UPDATE ON qm.queues
    FOR EACH ROW
    WHEN ((to_jsonb(OLD) - ARRAY['enq_seqs', 'done_seqs', 'updated_at'])
          IS DISTINCT FROM (to_jsonb(NEW) - ARRAY['enq_seqs', 'done_seqs', 'updated_at']))
    EXECUTE FUNCTION qm.notify_settings_changed();

CREATE FUNCTION qm.notify_tenant_settings_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('qm_wake', q.name || ' settings')
       FROM qm.queues q WHERE q.id = coalesce(NEW.queue_id, OLD.queue_id);
    RETURN NULL;
END
$$;

CREATE TRIGGER qm_tenant_settings_changed AFTER INSERT OR UPDATE OR DELETE ON qm.tenant_settings
    FOR EACH ROW EXECUTE FUNCTION qm.notify_tenant_settings_changed();
