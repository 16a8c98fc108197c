-- The web dashboard's reads (queue_manager/web/, docs/dashboard.md; its actions are admin.sql's).
-- Each is bounded: by a primary key or index lookup, by a capped scan of the newest rows
-- (%(scan)s), or by a LIMIT, and every dashboard connection runs under a statement timeout. The
-- event browser's filters are admin.sql's event_filters, put in where a query says {filters}.

-- web_events_page --
-- One page of a queue's events on this shard, newest first, below the keyset cursor %(before)s
-- (NULL: from the newest), among at most %(scan)s of the newest rows there.
SELECT e.id, e.tenant, e.partition, e.fire_at, e.state::text AS state, e.attempts, e.dedup_key, e.created_at,
       e.fired_at, e.acked_at, left(e.last_error, 200) AS last_error, left(e.payload::text, 160) AS payload_head
  FROM (SELECT * FROM {queue}
         WHERE (%(before)s::bigint IS NULL OR id < %(before)s::bigint)
         ORDER BY id DESC
         LIMIT %(scan)s) e
 WHERE {filters}
 ORDER BY e.id DESC
 LIMIT %(limit)s

-- web_events_by_id --
-- The event of one id, if it matches the other filters (an id filter needs no scan).
SELECT e.id, e.tenant, e.partition, e.fire_at, e.state::text AS state, e.attempts, e.dedup_key, e.created_at,
       e.fired_at, e.acked_at, left(e.last_error, 200) AS last_error, left(e.payload::text, 160) AS payload_head
  FROM {queue} e
 WHERE e.id = %(id)s::bigint
   AND {filters}

-- web_events_scanned --
-- How many rows the capped scan below %(before)s covered, and the lowest id it reached (an
-- index-only walk of the primary key).
SELECT count(*) AS scanned, min(id) AS floor
  FROM (SELECT id FROM {queue}
         WHERE (%(before)s::bigint IS NULL OR id < %(before)s::bigint)
         ORDER BY id DESC
         LIMIT %(scan)s) s

-- web_event --
-- One event, whole.
SELECT id, tenant, partition, fire_at, state::text AS state, attempts, dedup_key, created_at, fired_at, acked_at,
       ack_deadline, fired_term, last_error, priority, concurrency_key, rate_key, jsonb_pretty(payload) AS payload
  FROM {queue}
 WHERE id = %(id)s

-- web_leader --
-- The shard's leadership lease: term, holder, and how fresh the lease is (expires_at is -infinity
-- until a manager first leads: NULL here).
SELECT term, holder, holder_pid, acquired_at, renewed_at, CASE WHEN isfinite(expires_at) THEN expires_at END AS expires_at,
       expires_at > now() AS live,
       extract(epoch FROM now() - renewed_at)::double precision AS lease_age_seconds
  FROM qm.leader

-- web_top_tenants --
-- The tenants with the most live events (to_be_fired + fired) among at most %(scan)s of them, and
-- the age of each one's oldest due event.
SELECT tenant, count(*) AS live,
       extract(epoch FROM now() - min(fire_at) FILTER (WHERE state = 'to_be_fired' AND fire_at <= now()))::double precision
           AS oldest_due_age_seconds
  FROM (SELECT tenant, state, fire_at FROM {queue} WHERE state IN ('to_be_fired', 'fired') LIMIT %(scan)s) s
 GROUP BY tenant
 ORDER BY live DESC, tenant
 LIMIT %(limit)s

-- web_spark_runs --
-- The newest Spark enqueue runs on this shard (qm.spark_runs; docs/spark.md).
SELECT run_id, queue, state, staged_rows, published, rejected_rows, dedup_skipped, started_at, updated_at
  FROM qm.spark_runs
 ORDER BY updated_at DESC
 LIMIT %(limit)s

-- web_prepared --
-- Transactions left prepared in this database (a two-phase Spark run that did not finish: `qm
-- spark recover` ends them), oldest first; they hold back vacuum.
SELECT gid, owner, prepared, extract(epoch FROM now() - prepared)::double precision AS age_seconds
  FROM pg_prepared_xacts
 WHERE database = current_database()
 ORDER BY prepared
 LIMIT %(limit)s

-- web_live_queues --
-- The overview's reading of every queue on this shard, without a scan of any queue table: the
-- registry row, each partition's load counters (enqueued and done, from sequences: what the
-- routing trigger reads; docs/design.md, "Shuffle sharding") and, as estimates, the entries of the
-- acked and failed partial indexes as of their last vacuum or analyze (pg_class.reltuples; -1:
-- never counted).
SELECT q.name, q.partitions, q.partitions_physical, q.paused, q.max_qps, q.max_concurrency,
       (SELECT array_agg(coalesce(pg_sequence_last_value(u.s), 0) ORDER BY u.o)
          FROM unnest(q.enq_seqs) WITH ORDINALITY AS u(s, o)) AS enq,
       (SELECT array_agg(coalesce(pg_sequence_last_value(u.s), 0) ORDER BY u.o)
          FROM unnest(q.done_seqs) WITH ORDINALITY AS u(s, o)) AS done,
       (SELECT c.reltuples FROM pg_class c WHERE c.oid = to_regclass(format('public.%I', q.name || '_acked')))
           AS acked_estimate,
       (SELECT c.reltuples FROM pg_class c WHERE c.oid = to_regclass(format('public.%I', q.name || '_failed')))
           AS failed_estimate
  FROM qm.queues q
 ORDER BY q.name

-- web_live_queue --
-- The bounded reads of one queue's overview row, each through a partial index: events in hand
-- (<queue>_fired) and dead letters (<queue>_failed), each counted up to %(cap)s; per partition,
-- the first due event (the first entry of each priority level of <queue>_due) and the due events counted up to
-- %(due_cap)s; and the pickup delay (fire_at to the last fire) of the newest acked events, at most
-- %(recent)s per partition and acked within the last %(recent_seconds)s seconds (<queue>_acked).
WITH parts AS (
    SELECT p.part, first.fire_at AS first_fire_at, due.n AS due
      FROM generate_series(0, %(parts)s - 1) AS p(part)
      LEFT JOIN LATERAL (SELECT min(l.fire_at) AS fire_at
                           FROM generate_series(1, 5) AS lv(v)
                          CROSS JOIN LATERAL (SELECT e.fire_at FROM {queue} e
                                               WHERE e.state = 'to_be_fired' AND e.partition = p.part
                                                 AND e.priority = lv.v
                                               ORDER BY e.fire_at LIMIT 1) l) first ON true
     CROSS JOIN LATERAL (SELECT count(*) AS n FROM (SELECT 1 FROM {queue} e
                          WHERE e.state = 'to_be_fired' AND e.partition = p.part AND e.fire_at <= now()
                          LIMIT %(due_cap)s) x) due
)
SELECT (SELECT count(*) FROM (SELECT 1 FROM {queue} WHERE state = 'fired' LIMIT %(cap)s) f) AS fired,
       (SELECT count(*) FROM (SELECT 1 FROM {queue} WHERE state = 'failed' LIMIT %(cap)s) d) AS failed,
       (SELECT extract(epoch FROM now() - min(first_fire_at))::double precision FROM parts
         WHERE first_fire_at <= now()) AS oldest_due_age_seconds,
       (SELECT coalesce(sum(due), 0)::bigint FROM parts) AS due_now,
       (SELECT coalesce(bool_or(due >= %(due_cap)s), false) FROM parts) AS due_capped,
       (SELECT array_agg(r.delay ORDER BY r.delay)
          FROM generate_series(0, %(parts)s - 1) AS p(part)
         CROSS JOIN LATERAL (SELECT greatest(extract(epoch FROM e.fired_at - e.fire_at), 0)::double precision AS delay
                               FROM {queue} e
                              WHERE e.state = 'acked' AND e.partition = p.part
                                AND e.acked_at > now() - make_interval(secs => %(recent_seconds)s)
                              ORDER BY e.acked_at DESC LIMIT %(recent)s) r
         WHERE r.delay IS NOT NULL) AS pickup_delays

-- web_exact_counts --
-- A queue's exact counts by state on this shard: a scan of its table (on demand only, under the
-- statement timeout).
SELECT state::text AS state, count(*) AS n
  FROM {queue}
 GROUP BY state

-- web_listen --
-- The live reading's listener: every notification on qm_wake (queue_manager/manager/notices.py
-- lists who sends them) brings the next reading forward.
LISTEN qm_wake

-- web_alive --
-- The listener's periodic check that its connection still works (a listener on a half-open
-- connection would hear nothing, silently).
SELECT 1

-- web_archive_runs --
-- The newest Spark archive runs on this shard (qm.archive_runs, revision 0004; docs/spark-archive.md).
SELECT run_id, stage, planned, archived, deleted, detail, started_at, updated_at
  FROM qm.archive_runs
 ORDER BY updated_at DESC
 LIMIT %(limit)s
