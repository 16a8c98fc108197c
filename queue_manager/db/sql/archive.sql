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
-- never this run's) and the candidates at or below it, settled (acked, cancelled or failed) before the cut-off.
SELECT m.max_id, c.n, c.lo, c.hi
  FROM (SELECT coalesce(max(id), 0) AS max_id FROM {queue}) m
 CROSS JOIN LATERAL (
    SELECT count(*) AS n, min(q.id) AS lo, max(q.id) AS hi
      FROM {queue} q
     WHERE q.id <= m.max_id AND q.state IN ('acked', 'cancelled', 'failed')
       AND coalesce(q.acked_at, q.fired_at, q.created_at) < %(cutoff)s) c

-- archive_source --
-- Spark's JDBC `dbtable` for one queue's candidates (Spark adds each read partition's id range).
-- {max_id} and {cutoff} are literals: a JDBC source takes no parameters. The day (UTC) of the
-- settle time is computed here as text, so that no JVM or session time zone can shift it.
(SELECT q.id, q.tenant, q.partition, q.fire_at, q.state::text AS state, q.attempts, q.payload::text AS payload,
        q.dedup_key, q.created_at, q.fired_at, q.acked_at, q.ack_deadline, q.fired_term, q.last_error,
        q.traceparent, q.tracestate, q.baggage,
        coalesce(q.acked_at, q.fired_at, q.created_at) AS settled_at,
        to_char(coalesce(q.acked_at, q.fired_at, q.created_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD') AS day
   FROM {queue} q
  WHERE q.id <= {max_id} AND q.state IN ('acked', 'cancelled', 'failed')
    AND coalesce(q.acked_at, q.fired_at, q.created_at) < {cutoff}) AS qm_archive_source

-- archive_delete --
-- Delete archived rows by id, only while they are still what was archived: settled before the
-- cut-off and within the run's ids. A row retried, re-fired or settled again since it was read
-- fails the guard and stays. The state is compared as text, so the planner probes the primary key.
DELETE FROM {queue} q
 WHERE q.id = ANY(%(ids)s::bigint[]) AND q.id <= %(max_id)s AND q.state::text IN ('acked', 'cancelled', 'failed')
   AND coalesce(q.acked_at, q.fired_at, q.created_at) < %(cutoff)s

-- archive_kept --
-- Which of these ids are still in the table (after archive_delete: the rows its guard kept).
SELECT id FROM {queue} WHERE id = ANY(%(ids)s::bigint[]) ORDER BY id

-- archive_ledger --
-- One step of a run on this shard, in its ledger row (qm.archive_runs, revision 0004): the stage,
-- and the rows where the stage counts them (planned, committed; a delete slice adds its rows, the
-- final deleted sets the total).
INSERT INTO qm.archive_runs AS r (run_id, stage, planned, archived, deleted, detail)
VALUES (%(run_id)s, %(stage)s,
        CASE WHEN %(stage)s = 'planned' THEN %(rows)s::bigint END,
        CASE WHEN %(stage)s = 'committed' THEN %(rows)s::bigint END,
        CASE WHEN %(stage)s IN ('delete_slice', 'deleted') THEN %(rows)s::bigint ELSE 0 END,
        %(detail)s)
ON CONFLICT (run_id) DO UPDATE
   SET stage = CASE WHEN excluded.stage = 'delete_slice' AND r.stage = 'deleted' THEN r.stage ELSE excluded.stage END,
       planned = coalesce(excluded.planned, r.planned),
       archived = coalesce(excluded.archived, r.archived),
       deleted = CASE excluded.stage WHEN 'delete_slice' THEN r.deleted + excluded.deleted
                                     WHEN 'deleted' THEN excluded.deleted
                                     ELSE r.deleted END,
       detail = CASE WHEN excluded.detail = '' THEN r.detail ELSE excluded.detail END,
       updated_at = now()
