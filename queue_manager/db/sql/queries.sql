-- Runtime queries, one named block each ("-- name --"). `{queue}` is a queue table name,
-- filled in with psycopg.sql.Identifier after queue_manager.domain.names.check_queue_name.

-- enqueue --
-- One event in the caller's transaction; the database picks the partition. No row back = dedup hit.
INSERT INTO {queue} (tenant, payload, fire_at, dedup_key)
VALUES (%(tenant)s, %(payload)s, coalesce(%(fire_at)s, clock_timestamp()), %(dedup_key)s)
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
    tenant text, partition smallint, payload jsonb, fire_at timestamptz, dedup_key text
) ON COMMIT DELETE ROWS

-- insert_from_staging --
INSERT INTO {queue} (tenant, partition, payload, fire_at, dedup_key)
SELECT tenant, partition, payload, coalesce(fire_at, clock_timestamp()), dedup_key FROM qm_staging
ON CONFLICT (tenant, dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING

-- truncate_staging --
TRUNCATE qm_staging

-- create_queue --
SELECT * FROM qm.create_queue(%(queue)s, %(settings)s, %(if_not_exists)s)

-- alter_queue --
SELECT * FROM qm.alter_queue(%(queue)s, %(settings)s)

-- finish_resize --
SELECT qm.finish_resize(%(queue)s) AS remaining

-- list_queues --
SELECT name, partitions, partitions_physical, shuffle, window_seconds, cache_size, ack_timeout_seconds,
       backoff_min_seconds, backoff_max_seconds, max_attempts, max_qps, max_concurrency, retention_seconds,
       payload_limit_bytes, max_delay_seconds, paused, created_at, updated_at
  FROM qm.queues
 ORDER BY name

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
