-- Runtime queries, one named block each ("-- name --"). `{queue}` is a queue table name,
-- filled in with psycopg.sql.Identifier after queue_manager.domain.names.check_queue_name.

-- enqueue --
-- One event in the caller's transaction; the database picks the partition. No row back = dedup hit.
-- The trace context (W3C) is NULL when the producer has none (queue_manager.tracing).
INSERT INTO {queue} (tenant, payload, fire_at, dedup_key, traceparent, tracestate, baggage)
VALUES (%(tenant)s, %(payload)s, coalesce(%(fire_at)s, clock_timestamp()), %(dedup_key)s,
        %(traceparent)s, %(tracestate)s, %(baggage)s)
RETURNING id

-- queue_routing_info --
-- What a bulk loader needs to place events itself: N, k, the shard's range, current loads (one per
-- physical partition, so at least N), and the time for events without fire_at (the column default's).
SELECT q.partitions, q.shuffle, q.payload_limit_bytes, s.name AS shard_name, s.range_start, s.range_end,
       qm.partition_loads(q.name) AS loads, clock_timestamp() AS now
  FROM qm.queues q
  LEFT JOIN qm.shard s ON true
 WHERE q.name = %(queue)s

-- add_load --
SELECT qm.add_load(%(queue)s, %(partitions)s, %(counts)s)

-- create_staging --
-- Session-private staging table for bulk loads that need ON CONFLICT (dedup keys).
CREATE TEMP TABLE IF NOT EXISTS qm_staging (
    tenant text, partition smallint, payload jsonb, fire_at timestamptz, dedup_key text,
    traceparent text, tracestate text, baggage text
) ON COMMIT DELETE ROWS

-- insert_from_staging --
INSERT INTO {queue} (tenant, partition, payload, fire_at, dedup_key, traceparent, tracestate, baggage)
SELECT tenant, partition, payload, coalesce(fire_at, clock_timestamp()), dedup_key, traceparent, tracestate, baggage
  FROM qm_staging
ON CONFLICT (tenant, dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING

-- truncate_staging --
TRUNCATE qm_staging

-- queue_exists --
-- Whether the queue is registered on this shard (before a create: did it exist already?).
SELECT EXISTS (SELECT 1 FROM qm.queues WHERE name = %(queue)s) AS existed

-- create_queue --
SELECT * FROM qm.create_queue(%(queue)s, %(settings)s, %(if_not_exists)s)

-- alter_queue --
SELECT * FROM qm.alter_queue(%(queue)s, %(settings)s)

-- finish_resize --
SELECT qm.finish_resize(%(queue)s) AS remaining

-- list_queues --
SELECT name, partitions, partitions_physical, shuffle, window_seconds, cache_size, ack_timeout_seconds,
       backoff_min_seconds, backoff_max_seconds, max_attempts, max_qps, max_concurrency, retention_seconds,
       payload_limit_bytes, max_delay_seconds, paused, created_at, updated_at, failed_retention_seconds,
       tenant_max_in_flight
  FROM qm.queues
 ORDER BY name

-- set_tenant --
SELECT * FROM qm.set_tenant(%(queue)s, %(tenant)s, %(settings)s)

-- unset_tenant --
SELECT qm.unset_tenant(%(queue)s, %(tenant)s) AS removed

-- list_tenants --
-- Tenant overrides of one queue (or of every queue when %(queue)s is NULL) on this shard.
SELECT q.name AS queue, t.tenant, t.weight, t.max_in_flight, q.tenant_max_in_flight AS queue_default_max_in_flight,
       t.updated_at
  FROM qm.tenant_settings t
  JOIN qm.queues q ON q.id = t.queue_id
 WHERE %(queue)s::text IS NULL OR q.name = %(queue)s::text
 ORDER BY q.name, t.tenant

-- shard_identity --
SELECT name, range_start, range_end FROM qm.shard

-- queue_state_counts --
-- Exact counts by partition and state (a scan of the queue table).
SELECT partition, state::text AS state, count(*) AS n
  FROM {queue}
 GROUP BY partition, state

-- queue_oldest_due --
-- The oldest event already due, through the (partition, fire_at) index: its age is the backlog's lag.
SELECT extract(epoch FROM now() - min(fire_at))::double precision AS oldest_due_age_seconds,
       count(*) AS due_now
  FROM {queue}
 WHERE state = 'to_be_fired' AND fire_at <= now()

-- xmin_horizon --
-- What holds back vacuum in this database: the oldest of the sessions' transactions and snapshots,
-- the prepared transactions and the replication slots. Ties in xid age go to the oldest
-- transaction: a session whose snapshot began while the holder ran has the holder's xid as its
-- xmin, the same xid age, but it is not what holds the horizon.
SELECT kind, holder, pid, application_name, state, age_seconds, xid_age FROM (
    SELECT 'session' AS kind, coalesce(nullif(a.application_name, ''), a.backend_type) AS holder, a.pid,
           a.application_name, a.state,
           extract(epoch FROM clock_timestamp() - coalesce(a.xact_start, a.backend_start))::double precision AS age_seconds,
           age(coalesce(a.backend_xmin, a.backend_xid))::bigint AS xid_age
      FROM pg_stat_activity a
     WHERE (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL) AND a.pid <> pg_backend_pid()
       AND a.datname = current_database()
    UNION ALL
    SELECT 'prepared', p.gid, NULL, NULL, NULL,
           extract(epoch FROM clock_timestamp() - p.prepared)::double precision, age(p.transaction)::bigint
      FROM pg_prepared_xacts p
     WHERE p.database = current_database()
    UNION ALL
    SELECT 'slot', s.slot_name, s.active_pid, NULL, NULL, NULL, age(coalesce(s.xmin, s.catalog_xmin))::bigint
      FROM pg_replication_slots s
     WHERE s.xmin IS NOT NULL OR s.catalog_xmin IS NOT NULL
) h
ORDER BY xid_age DESC NULLS LAST, age_seconds DESC NULLS LAST
LIMIT 1

-- maintenance_counts --
-- The maintenance jobs' slices on this shard, every manager together: recruited, finished,
-- aborted, and the events they handled (sequences, see schema/maintenance/count_maintenance.sql).
SELECT job, recruited, finished, aborted, events FROM qm.maintenance_counts()
