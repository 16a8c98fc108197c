-- Revision 0001_baseline: the tables, types, sequences, indexes and seed rows of a shard, as the
-- history before it (revisions 0001 to 0013_enqueue_lock, squashed) left them. The functions,
-- trigger generators and the triggers on these tables are not here: they are source, under
-- sql/schema/, applied after every migration (queue_manager/db/schema.py). A database migrated by
-- that history is carried over by its version alone (docs/design.md, "Schema source and
-- migrations").
--
-- Per queue, qm.create_queue adds public.<queue> (the queue table) and qm.apply_queue its counters,
-- qm.q<id>_p<n>_enq and qm.q<id>_p<n>_done (sequences), and its generated functions and triggers.

CREATE SCHEMA IF NOT EXISTS qm;

CREATE TYPE qm.event_state AS ENUM ('to_be_fired', 'fired', 'acked', 'failed');

-- ------------------------------------------------------------------ shard identity and topology

-- this shard's identity and keyspace range (one row; qm.set_topology)
CREATE TABLE qm.shard (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    name        text NOT NULL,
    range_start text NOT NULL,   -- 16 hex digits, '' = start of keyspace
    range_end   text NOT NULL,   -- 16 hex digits, '' = end of keyspace
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- every shard of the topology (to name the right shard in errors)
CREATE TABLE qm.shard_map (
    name        text PRIMARY KEY,
    range_start text NOT NULL,
    range_end   text NOT NULL
);

-- ------------------------------------------------------------------ the queue registry

-- one row per queue, with its settings (docs/operations.md, "Queues")
CREATE TABLE qm.queues (
    id                  integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name                text NOT NULL UNIQUE CHECK (name ~ '^[a-z][a-z0-9_]{0,39}$' AND name NOT LIKE 'qm\_%'),
    -- N: partitions new events are written to
    partitions          integer NOT NULL DEFAULT 16 CHECK (partitions BETWEEN 1 AND 1024),
    -- partitions that may still hold events: > partitions while a shrink drains
    partitions_physical integer NOT NULL DEFAULT 16 CHECK (partitions_physical >= partitions),
    -- k: shuffle-shard size
    shuffle             integer NOT NULL DEFAULT 4 CHECK (shuffle BETWEEN 1 AND 16 AND shuffle <= partitions),
    window_seconds      double precision NOT NULL DEFAULT 30 CHECK (window_seconds > 0 AND window_seconds <= 3600),
    cache_size          integer NOT NULL DEFAULT 10000 CHECK (cache_size BETWEEN 1 AND 10000000),
    ack_timeout_seconds double precision NOT NULL DEFAULT 30 CHECK (ack_timeout_seconds > 0 AND ack_timeout_seconds <= 86400),
    backoff_min_seconds double precision NOT NULL DEFAULT 1 CHECK (backoff_min_seconds >= 0),
    backoff_max_seconds double precision NOT NULL DEFAULT 300,
    max_attempts        integer NOT NULL DEFAULT 20 CHECK (max_attempts BETWEEN 1 AND 1000),
    max_qps             double precision CHECK (max_qps IS NULL OR max_qps > 0),
    max_concurrency     integer CHECK (max_concurrency IS NULL OR max_concurrency > 0),
    retention_seconds   double precision NOT NULL DEFAULT 604800 CHECK (retention_seconds >= 0),
    payload_limit_bytes integer NOT NULL DEFAULT 65536 CHECK (payload_limit_bytes BETWEEN 16 AND 104857600),
    max_delay_seconds   double precision NOT NULL DEFAULT 315576000 CHECK (max_delay_seconds > 0),
    paused              boolean NOT NULL DEFAULT false,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    -- enqueue counters, element p+1 for partition p (length partitions_physical)
    enq_seqs            regclass[] NOT NULL DEFAULT '{}',
    -- done counters, same indexing
    done_seqs           regclass[] NOT NULL DEFAULT '{}',
    -- failed events are deleted this long after their last fire; NULL keeps them
    failed_retention_seconds double precision DEFAULT 2592000
        CHECK (failed_retention_seconds IS NULL OR failed_retention_seconds >= 0),
    -- the default cap on one tenant's events in flight (per shard); NULL = no cap
    tenant_max_in_flight integer CHECK (tenant_max_in_flight IS NULL OR tenant_max_in_flight > 0),
    CHECK (backoff_max_seconds >= backoff_min_seconds)
);

COMMENT ON COLUMN qm.queues.max_delay_seconds IS 'latest accepted fire_at, relative to now() at insert';
COMMENT ON COLUMN qm.queues.failed_retention_seconds IS
    'failed events are deleted this long after their last fire; NULL keeps them';

-- overrides for one tenant of one queue: weight (its share of fires among backlogged tenants) and
-- max_in_flight (its own cap; NULL = the queue's tenant_max_in_flight). Kept on the tenant's own
-- shard only (qm.set_tenant).
CREATE TABLE qm.tenant_settings (
    queue_id      integer NOT NULL REFERENCES qm.queues (id) ON DELETE CASCADE,
    tenant        text NOT NULL CHECK (tenant <> ''),
    weight        double precision NOT NULL DEFAULT 1 CHECK (weight > 0 AND weight <= 1000),
    max_in_flight integer CHECK (max_in_flight IS NULL OR max_in_flight > 0),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue_id, tenant)
);

COMMENT ON TABLE qm.tenant_settings IS 'per-tenant dispatch overrides of a queue: weight (default 1), max_in_flight';

-- ------------------------------------------------------------------ the manager

-- The leadership lease, one row: the current term, who holds it, until when (qm.acquire_leadership,
-- qm.fence; docs/manager.md).
CREATE TABLE qm.leader (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    term        bigint NOT NULL DEFAULT 0,
    holder      text,
    holder_pid  integer,
    acquired_at timestamptz,
    renewed_at  timestamptz,
    expires_at  timestamptz NOT NULL DEFAULT '-infinity'
);
INSERT INTO qm.leader DEFAULT VALUES;

-- One row per (queue, shard whose manager wrote it): the slice of the queue's max_qps and
-- max_concurrency that shard's active manager may use, what it wants, and whether it has a raise
-- pending. Every active manager writes its rows into every shard's database it can reach and reads
-- its peers' rows from its own shard's database only (queue_manager/manager/budget.py; docs/design.md,
-- "Rate and concurrency limits across shards"). renewed_at is the clock of the database that stores
-- the copy, and readers judge a copy's age by that same database's clock, so clock skew between
-- servers never enters. A row never goes back: an update from an older leader term than the row's
-- is ignored, and seq grows by one with every write.
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

-- The maintenance slices' counters, shard-wide, per job of qm.maintenance_jobs(): slices recruited,
-- finished and aborted, and the events they handled (qm.count_maintenance, qm.maintenance_counts).
CREATE SEQUENCE qm.maint_collector_recruited;
CREATE SEQUENCE qm.maint_collector_finished;
CREATE SEQUENCE qm.maint_collector_aborted;
CREATE SEQUENCE qm.maint_collector_events;
CREATE SEQUENCE qm.maint_retention_recruited;
CREATE SEQUENCE qm.maint_retention_finished;
CREATE SEQUENCE qm.maint_retention_aborted;
CREATE SEQUENCE qm.maint_retention_events;
CREATE SEQUENCE qm.maint_reconciliation_recruited;
CREATE SEQUENCE qm.maint_reconciliation_finished;
CREATE SEQUENCE qm.maint_reconciliation_aborted;
CREATE SEQUENCE qm.maint_reconciliation_events;

-- ------------------------------------------------------------------ bulk loads from Spark

-- The run ledger, one row per (run, queue) on each shard: staging -> staged -> published, or
-- abandoned. A two-phase publish writes 'published' inside its prepared transaction: it shows at
-- COMMIT PREPARED, and a rollback leaves the run staged (docs/spark.md; qm.stage_run, qm.staged_run,
-- qm.publish_run).
CREATE TABLE qm.spark_runs (
    run_id       text NOT NULL,
    queue        text NOT NULL,
    state        text NOT NULL CHECK (state IN ('staging', 'staged', 'published', 'abandoned')),
    staged_rows  bigint,
    published    bigint,
    started_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- the run's stage table on this shard (qm.spark_stage_<n>), NULL once dropped
    stage_table  text,
    -- distinct rows staged without a reason, and with one (rejected)
    good_rows    bigint,
    rejected_rows bigint,
    -- rows written twice by retried or speculative tasks (kept once)
    duplicate_rows bigint,
    -- good rows skipped at publish because their (tenant, dedup_key) already existed
    dedup_skipped bigint,
    -- what the manager is told after a two-phase commit: the earliest fire_at, or the publish's start
    wake_at      timestamptz,
    PRIMARY KEY (run_id, queue)
);
COMMENT ON TABLE qm.spark_runs IS 'Spark load ledger: one row per (run, queue) on each shard; see spark_jobs/enqueue.py';

-- On the coordinating shard of a two-phase run: written after every shard prepared and before any
-- commits. Recovery records 'abort' for an undecided run before it rolls anything back, and a job
-- records 'commit' only if no abort is there, so the two can never both act on one run.
CREATE TABLE qm.spark_decisions (
    run_id      text NOT NULL,
    queue       text NOT NULL,
    shards      text[] NOT NULL,
    decided_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    outcome     text NOT NULL DEFAULT 'commit' CHECK (outcome IN ('commit', 'abort')),
    PRIMARY KEY (run_id, queue)
);

-- numbers the per-run stage tables qm.spark_stage_<n> (UNLOGGED, created by qm.stage_run)
CREATE SEQUENCE qm.spark_stage_seq;

-- ------------------------------------------------------------------ adopting a legacy queue table

-- The adoption ledger (docs/design.md, "Adopting a legacy queue table"): one row per legacy event
-- published into one of this shard's queues, written in the same transaction as the event. Its key
-- is the key the event's row got in the legacy database's outbox (a random uuid, never reused), so
-- a re-run after a crash between the two databases' commits finds the event already here and does
-- not publish it twice. A row is needed only until the outbox row is deleted; qm queue adopt then
-- deletes it.
CREATE TABLE qm.adopted (
    key        uuid PRIMARY KEY,
    -- the adoption's name (qm queue adopt --name)
    adoption   text NOT NULL,
    -- which outbox the key came from: '<system identifier>/<database>/<outbox table>'
    source     text NOT NULL,
    queue      text NOT NULL,
    -- the legacy row's id, as text (for an operator reading the ledger)
    legacy_id  text NOT NULL,
    adopted_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX adopted_adoption ON qm.adopted (adoption, source);
