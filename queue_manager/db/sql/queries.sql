-- Runtime queries, one named block each ("-- name --"). `{queue}` is a queue table name,
-- filled in with psycopg.sql.Identifier after queue_manager.domain.names.check_queue_name.

-- enqueue --
-- One event in the caller's transaction; the database picks the partition. No row back = dedup hit.
-- The trace context (W3C) is NULL when the producer has none (queue_manager.tracing), as are the
-- keys; the priority is the column's default, the queue's default_priority (enqueue_priority names it).
INSERT INTO {queue} (tenant, payload, fire_at, dedup_key, traceparent, tracestate, baggage, concurrency_key, rate_key)
VALUES (%(tenant)s, %(payload)s, coalesce(%(fire_at)s, clock_timestamp()), %(dedup_key)s,
        %(traceparent)s, %(tracestate)s, %(baggage)s, %(concurrency_key)s, %(rate_key)s)
RETURNING id

-- enqueue_priority --
-- enqueue with the event's own priority.
INSERT INTO {queue} (tenant, payload, fire_at, dedup_key, traceparent, tracestate, baggage, concurrency_key, rate_key,
                     priority)
VALUES (%(tenant)s, %(payload)s, coalesce(%(fire_at)s, clock_timestamp()), %(dedup_key)s,
        %(traceparent)s, %(tracestate)s, %(baggage)s, %(concurrency_key)s, %(rate_key)s, %(priority)s)
RETURNING id

-- queue_routing_info --
-- What a bulk loader needs to place events itself: N, k, the shard's range, current loads (one per
-- physical partition, so at least N), and the time for events without fire_at (the column default's).
SELECT q.partitions, q.shuffle, q.payload_limit_bytes, s.name AS shard_name, s.range_start, s.range_end,
       qm.partition_loads(q.name) AS loads, clock_timestamp() AS now, q.default_priority
  FROM qm.queues q
  LEFT JOIN qm.shard s ON true
 WHERE q.name = %(queue)s

-- add_load --
SELECT qm.add_load(%(queue)s, %(partitions)s, %(counts)s)

-- create_staging --
-- Session-private staging table for bulk loads that need ON CONFLICT (dedup keys).
CREATE TEMP TABLE IF NOT EXISTS qm_staging (
    tenant text, partition smallint, payload jsonb, fire_at timestamptz, dedup_key text,
    traceparent text, tracestate text, baggage text, priority smallint, concurrency_key text, rate_key text
) ON COMMIT DELETE ROWS

-- insert_from_staging --
INSERT INTO {queue} (tenant, partition, payload, fire_at, dedup_key, traceparent, tracestate, baggage, priority,
                     concurrency_key, rate_key)
SELECT tenant, partition, payload, coalesce(fire_at, clock_timestamp()), dedup_key, traceparent, tracestate, baggage,
       coalesce(priority, %(default_priority)s), concurrency_key, rate_key
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
       tenant_max_in_flight, default_priority, priority_aging_seconds, key_max_in_flight, key_max_qps
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

-- set_key --
SELECT * FROM qm.set_key(%(queue)s, %(tenant)s, %(key)s, %(settings)s)

-- unset_key --
SELECT qm.unset_key(%(queue)s, %(tenant)s, %(key)s) AS removed

-- list_keys --
-- The keys' own limits of one queue (or of every queue when %(queue)s is NULL) on this shard.
SELECT q.name AS queue, k.tenant, k.key, k.max_in_flight, k.max_qps,
       q.key_max_in_flight AS queue_default_max_in_flight, q.key_max_qps AS queue_default_max_qps, k.updated_at
  FROM qm.key_settings k
  JOIN qm.queues q ON q.id = k.queue_id
 WHERE %(queue)s::text IS NULL OR q.name = %(queue)s::text
 ORDER BY q.name, k.tenant, k.key

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

-- queue_keys_in_hand --
-- The concurrency keys with the most events in hand (fired, through the fired index, at most
-- %(cap)s of them read), each with its limit (its own max_in_flight, else the queue's
-- key_max_in_flight), and how many keys are held at their limit (the same on every row).
WITH q AS (SELECT id, key_max_in_flight FROM qm.queues WHERE name = %(queue)s),
     held AS (
        SELECT f.tenant, f.concurrency_key AS key, count(*) AS in_hand
          FROM (SELECT tenant, concurrency_key FROM {queue}
                 WHERE state = 'fired' AND concurrency_key IS NOT NULL LIMIT %(cap)s) f
         GROUP BY 1, 2),
     lim AS (
        SELECT h.tenant, h.key, h.in_hand, coalesce(k.max_in_flight, q.key_max_in_flight) AS max_in_flight
          FROM held h CROSS JOIN q
          LEFT JOIN qm.key_settings k ON k.queue_id = q.id AND k.tenant = h.tenant AND k.key = h.key)
SELECT tenant, key, in_hand, max_in_flight, (SELECT count(*) FROM lim WHERE in_hand >= max_in_flight) AS at_limit
  FROM lim
 ORDER BY in_hand DESC, tenant, key
 LIMIT %(top)s

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
