-- Runtime queries of the Spark bulk loader (spark_jobs/enqueue.py), one named block each
-- ("-- name --"). The functions they call are in schema/spark/.

-- shard_name --
SELECT name FROM qm.shard

-- queue_shape --
SELECT partitions, shuffle, payload_limit_bytes, max_delay_seconds FROM qm.queues WHERE name = %(queue)s

-- max_prepared_transactions --
SELECT current_setting('max_prepared_transactions')::integer

-- run_lock --
-- One live run per (queue, run id): a session lock on the coordinating shard (the topology's
-- first), taken before the run touches anything and held on a connection of the job's own until it
-- ends. It goes with the connection, so a killed job's retry gets it at once. Its class is its own
-- (queue_manager/db/locks.py).
SELECT pg_try_advisory_lock(qm.lock_class('spark_run'), hashtext(%(queue)s || chr(31) || %(run)s))

-- run_lock_wait --
-- The same lock, waited for up to the session's lock_timeout (run_lock_timeout).
SELECT pg_advisory_lock(qm.lock_class('spark_run'), hashtext(%(queue)s || chr(31) || %(run)s))

-- run_lock_timeout --
SELECT set_config('lock_timeout', %(ms)s, false)

-- stage_run --
-- Begin or resume the run's staging: the ledger row (state, stage_table)
SELECT state, stage_table FROM qm.stage_run(%(run)s, %(queue)s)

-- copy_stage --
-- The rows of a run's stage table, from the CSV files Spark wrote (spark_jobs.enqueue._copy_stage),
-- its columns in the order of spark_jobs.enqueue.STAGE_COLUMNS.
COPY {stage} (row_key, tenant, partition, payload, fire_at_us, dedup_key, reason, traceparent, tracestate, baggage,
              priority, concurrency_key, rate_key)
    FROM STDIN (FORMAT csv)

-- staged_run --
SELECT reason, distinct_rows, written_rows FROM qm.staged_run(%(run)s, %(queue)s)

-- rejected_rows --
-- The rejected rows of a staged run, for its rejects output (read by Spark through JDBC).
SELECT DISTINCT ON (row_key) row_key, tenant, payload,
       timestamptz 'epoch' + fire_at_us * interval '1 microsecond' AS fire_at, dedup_key, reason
  FROM {stage}
 WHERE reason IS NOT NULL
 ORDER BY row_key

-- publish_run --
SELECT qm.publish_run(%(run)s, %(queue)s, %(two_phase)s)

-- abandon_run --
SELECT qm.abandon_run(%(run)s, %(queue)s)

-- cleanup_runs --
SELECT qm.cleanup_spark_runs(make_interval(secs => %(older_than)s))

-- ledger --
-- The run's ledger row on this shard, locked until the caller's transaction ends.
SELECT run_id, queue, state, stage_table, staged_rows, good_rows, rejected_rows, duplicate_rows, published,
       dedup_skipped, started_at, updated_at
  FROM qm.spark_runs
 WHERE run_id = %(run)s AND queue = %(queue)s
   FOR UPDATE

-- decide --
-- Record a two-phase run's outcome on the coordinating shard, unless one is recorded: the first
-- writer wins (a job's commit, or a recovery's abort). Returns the outcome that stands.
WITH ins AS (
    INSERT INTO qm.spark_decisions (run_id, queue, shards, outcome)
    VALUES (%(run)s, %(queue)s, %(shards)s, %(outcome)s)
    ON CONFLICT (run_id, queue) DO NOTHING
    RETURNING outcome)
SELECT outcome FROM ins
UNION ALL
SELECT outcome FROM qm.spark_decisions WHERE run_id = %(run)s AND queue = %(queue)s
LIMIT 1

-- prepared_runs --
-- This database's prepared parts of two-phase Spark runs, with their age in seconds.
SELECT gid, extract(epoch FROM clock_timestamp() - prepared)::double precision AS age_seconds
  FROM pg_prepared_xacts
 WHERE database = current_database() AND starts_with(gid, %(prefix)s)
 ORDER BY prepared

-- wake_after_publish --
-- After COMMIT PREPARED: the wake-up the verify trigger left to us (see qm.publish_run).
SELECT pg_notify('qm_wake', queue || ' at ' || (extract(epoch FROM wake_at) * 1000000)::bigint)
  FROM qm.spark_runs
 WHERE run_id = %(run)s AND queue = %(queue)s AND state = 'published' AND wake_at IS NOT NULL

-- forget_decision --
-- A new attempt of a two-phase run, once recovery has finished every prepared part of the earlier
-- ones: their decision (an abort, say) must not decide this attempt.
DELETE FROM qm.spark_decisions WHERE run_id = %(run)s AND queue = %(queue)s
