-- Revision 0010_rate_leases: rate and concurrency limits that hold across all shards, and settings changes
-- (pause, resume) that reach the manager at once.
--
--   qm.rate_leases       one row per (queue, shard whose manager wrote it): the slice of the queue's
--                        max_qps and max_concurrency that shard's active manager may use, what it
--                        wants, and whether it has a raise pending. Every active manager writes its
--                        rows into every shard's database it can reach and reads its peers' rows from
--                        its own shard's database only (queue_manager/manager/budget.py; the argument
--                        is in docs/design.md, "Rate and concurrency limits across shards").
--                        renewed_at is the clock of the database that stores the copy, and readers
--                        judge a copy's age by that same database's clock, so clock skew between
--                        servers never enters. A row never goes back: an update from an older leader
--                        term than the row's is ignored, and seq grows by one with every write.
--   qm_settings_changed  an AFTER trigger on qm.queues: NOTIFY qm_wake '<queue> settings' when a
--                        queue is created, dropped, or a setting the manager reads changes, so the
--                        manager reloads at once instead of at its next periodic reload.

CREATE TABLE qm.rate_leases (
    queue               text NOT NULL,
    -- the shard whose active manager holds this slice
    shard               text NOT NULL,
    -- host:pid:random of that manager, and its leader term on its own shard
    holder              text NOT NULL,
    term                bigint NOT NULL,
    -- bumped by every write of this copy
    seq                 bigint NOT NULL DEFAULT 1,
    -- clock_timestamp() of the database that stores this copy, at the write
    renewed_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- the copy is live while clock_timestamp() - renewed_at < ttl_seconds (this database's clock)
    ttl_seconds         double precision NOT NULL CHECK (ttl_seconds > 0),
    -- the manager gave its slices back (its session ended): never live
    resigned            boolean NOT NULL DEFAULT false,
    -- per limit (NULL when the queue has no such limit): what the manager wants ('Infinity': all it
    -- can get), the most it may be using (its claim), and whether a raise is pending
    want_qps            double precision,
    claim_qps           double precision,
    pending_qps         boolean NOT NULL DEFAULT false,
    want_concurrency    double precision,
    claim_concurrency   double precision,
    pending_concurrency boolean NOT NULL DEFAULT false,
    PRIMARY KEY (queue, shard)
) WITH (fillfactor = 50);

COMMENT ON TABLE qm.rate_leases IS
    'qm: slices of queue limits held by each shard''s manager; written by every manager to every shard, read locally';

CREATE FUNCTION qm.notify_settings_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- one notice per changed queue, delivered at commit; the manager reloads its settings
    PERFORM pg_notify('qm_wake', coalesce(NEW.name, OLD.name) || ' settings');
    RETURN NULL;
END
$$;

CREATE TRIGGER qm_settings_changed AFTER INSERT OR DELETE ON qm.queues
    FOR EACH ROW EXECUTE FUNCTION qm.notify_settings_changed();

-- Only the columns the manager reads (manager.sql, mgr_queues): the counters' bookkeeping
-- (enq_seqs, done_seqs, updated_at) changes no setting and sends nothing.
CREATE TRIGGER qm_settings_updated AFTER UPDATE ON qm.queues
    FOR EACH ROW
    WHEN ((OLD.name, OLD.partitions_physical, OLD.partitions, OLD.shuffle, OLD.window_seconds, OLD.cache_size,
           OLD.ack_timeout_seconds, OLD.backoff_min_seconds, OLD.backoff_max_seconds, OLD.max_attempts,
           OLD.max_qps, OLD.max_concurrency, OLD.retention_seconds, OLD.failed_retention_seconds, OLD.payload_limit_bytes,
           OLD.max_delay_seconds, OLD.paused)
          IS DISTINCT FROM
          (NEW.name, NEW.partitions_physical, NEW.partitions, NEW.shuffle, NEW.window_seconds, NEW.cache_size,
           NEW.ack_timeout_seconds, NEW.backoff_min_seconds, NEW.backoff_max_seconds, NEW.max_attempts,
           NEW.max_qps, NEW.max_concurrency, NEW.retention_seconds, NEW.failed_retention_seconds, NEW.payload_limit_bytes,
           NEW.max_delay_seconds, NEW.paused))
    EXECUTE FUNCTION qm.notify_settings_changed();
