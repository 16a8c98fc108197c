-- Queries of the archive job (spark_jobs/archive.py), one named block each ("-- name --").
-- `{queue}` is a queue table, filled in with psycopg.sql.Identifier after the allow-list check.
--
-- An event's settle time is coalesce(acked_at, fired_at, created_at). An acked event has acked_at.
-- A failed (dead-lettered) event records no time of its own: its last fire stands in (it failed at
-- most its ack deadline later), and created_at for one an application failed before any fire.
-- Every block below uses this same expression, so the rows read and the rows deleted agree.

-- archive_clock --
SELECT clock_timestamp()

-- archive_queue_names --
SELECT name FROM qm.queues ORDER BY name

-- archive_plan_queue --
-- A run's fixed bounds for one queue, in one snapshot: the highest id (max_id: rows above it are
-- never this run's) and the candidates at or below it, settled (acked or failed) before the cut-off.
SELECT m.max_id, c.n, c.lo, c.hi
  FROM (SELECT coalesce(max(id), 0) AS max_id FROM {queue}) m
 CROSS JOIN LATERAL (
    SELECT count(*) AS n, min(q.id) AS lo, max(q.id) AS hi
      FROM {queue} q
     WHERE q.id <= m.max_id AND q.state IN ('acked', 'failed')
       AND coalesce(q.acked_at, q.fired_at, q.created_at) < %(cutoff)s) c

-- archive_source --
-- Spark's JDBC `dbtable` for one queue's candidates (Spark adds each read partition's id range).
-- {max_id} and {cutoff} are literals: a JDBC source takes no parameters. The day (UTC) of the
-- settle time is computed here as text, so that no JVM or session time zone can shift it.
(SELECT q.id, q.tenant, q.partition, q.fire_at, q.state::text AS state, q.attempts, q.payload::text AS payload,
        q.dedup_key, q.created_at, q.fired_at, q.acked_at, q.ack_deadline, q.fired_term, q.last_error,
        coalesce(q.acked_at, q.fired_at, q.created_at) AS settled_at,
        to_char(coalesce(q.acked_at, q.fired_at, q.created_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD') AS day
   FROM {queue} q
  WHERE q.id <= {max_id} AND q.state IN ('acked', 'failed')
    AND coalesce(q.acked_at, q.fired_at, q.created_at) < {cutoff}) AS qm_archive_source

-- archive_delete --
-- Delete archived rows by id, only while they are still what was archived: settled before the
-- cut-off and within the run's ids. A row retried, re-fired or settled again since it was read
-- fails the guard and stays. The state is compared as text, so the planner probes the primary key.
DELETE FROM {queue} q
 WHERE q.id = ANY(%(ids)s::bigint[]) AND q.id <= %(max_id)s AND q.state::text IN ('acked', 'failed')
   AND coalesce(q.acked_at, q.fired_at, q.created_at) < %(cutoff)s

-- archive_kept --
-- Which of these ids are still in the table (after archive_delete: the rows its guard kept).
SELECT id FROM {queue} WHERE id = ANY(%(ids)s::bigint[]) ORDER BY id
