-- Named queries of the manager (loaded by queue_manager.db.sqlfiles.queries("manager.sql")).
-- {queue} is a queue table name checked against the allow-list. Every statement that changes an
-- event's state calls qm.fence(term) first (schema/leadership/fence.sql): a deposed manager's
-- writes fail.
--
-- Statements that change rows named by id guard their state as text (q.state::text = 'fired'):
-- the comparison guards the same, but it does not prove a partial index's predicate, so the
-- planner finds the rows by primary key. With state = 'fired' it could answer from the partial
-- index <queue>_fired and filter by id, which walks every dead entry of that index: measured under
-- a held snapshot, 2 969 buffer hits for 20 acks (3 per row by primary key).

-- mgr_queues --
-- The queues of this shard with the settings the manager needs.
-- Columns are read by name into queue_manager.domain.settings.QueueSettings: select exactly its fields.
SELECT id, name, partitions_physical, partitions, shuffle, window_seconds, cache_size, ack_timeout_seconds,
       backoff_min_seconds, backoff_max_seconds, max_attempts, max_qps, max_concurrency, retention_seconds,
       failed_retention_seconds, payload_limit_bytes, max_delay_seconds, paused, tenant_max_in_flight,
       default_priority, priority_aging_seconds, key_max_in_flight, key_max_qps
  FROM qm.queues ORDER BY id

-- mgr_tenant_settings --
-- Per-tenant overrides of this shard's queues (weight, max_in_flight), read with the queue settings.
-- Columns are read by name into queue_manager.domain.settings.TenantSettings.
SELECT queue_id, tenant, weight, max_in_flight FROM qm.tenant_settings ORDER BY queue_id, tenant

-- mgr_key_settings --
-- Per-key limits of this shard's queues (max_in_flight, max_qps), read with the queue settings.
-- Columns are read by name into queue_manager.domain.settings.KeySettings.
SELECT queue_id, tenant, key, max_in_flight, max_qps FROM qm.key_settings ORDER BY queue_id, tenant, key

-- mgr_shard --
SELECT name FROM qm.shard

-- mgr_acquire --
SELECT qm.acquire_leadership(%(holder)s, %(ttl)s)

-- mgr_lease --
-- What a standby looks at on each poll (a plain read, no lock): the lease's term, the backend its
-- holder renewed it from (NULL: no holder, or a reshard's), the seconds until it expires (negative
-- once it has), and whether the holder still has a connection (its process is alive and reaches
-- the database: qm.holder_connected).
SELECT l.term, l.holder_pid,
       CASE WHEN isfinite(l.expires_at) THEN extract(epoch FROM l.expires_at - clock_timestamp())::double precision
            ELSE -1e9 END AS expires_in,
       l.holder_pid IS NOT NULL AND qm.holder_connected(l.holder, l.holder_pid) AS connected
  FROM qm.leader l

-- mgr_take_over --
SELECT qm.take_over_leadership(%(holder)s, %(ttl)s, %(from_term)s, %(from_pid)s)

-- mgr_renew --
SELECT qm.renew_leadership(%(holder)s, %(term)s, %(ttl)s)

-- mgr_resign --
SELECT qm.release_leadership(%(holder)s, %(term)s)

-- mgr_arm --
-- Try (never wait) to take the wake locks of the given queues, for the session: a producer whose
-- shared try-lock then fails sends NOTIFY qm_wake. Returns the queue ids it holds.
SELECT array_agg(q) FILTER (WHERE pg_try_advisory_lock(qm.lock_class('wake'), q)) FROM unnest(%(ids)s::integer[]) AS q

-- mgr_disarm --
-- Give one queue's wake lock back: producers stop sending NOTIFY while the queue is busy. Returns
-- the statement's start on the database clock, which no producer that takes the lock after it
-- precedes (the manager's own estimate, read once the answer is back, can run tens of
-- milliseconds late on a loaded machine: floors.HolderWatch would then bound rows too high).
SELECT extract(epoch FROM statement_timestamp())::double precision
  FROM (SELECT pg_advisory_unlock(qm.lock_class('wake'), %(id)s)) AS u

-- mgr_wait_wake_lock --
-- Wait (on a connection of its own, without timeouts) for one queue's wake-up lock, which an open
-- producer transaction holds in shared mode. While this request waits, producers' shared try-locks
-- fail, so they NOTIFY (see queue_manager/manager/wakeups.py).
SELECT pg_advisory_lock(qm.lock_class('wake'), %(id)s)

-- mgr_wake_lock_waiters --
-- Which of the given backends wait (not yet granted) for a wake-up lock.
SELECT DISTINCT pid FROM pg_locks
 WHERE locktype = 'advisory' AND classid = qm.lock_class('wake') AND objsubid = 2 AND NOT granted
   AND pid = ANY(%(pids)s::integer[])

-- mgr_scan --
-- The window of one queue (the partitions in %(parts)s): per partition, the earliest to_be_fired events due before now + window,
-- at most %(quota)s each, read as an index range scan of {queue}_due per partition and priority level
-- (%(levels)s levels, each at most %(quota)s rows, the partition's earliest %(quota)s of them kept); with
-- future_only, only events not yet due (those due now go by mgr_fire_due), else only those after
-- their level's floor (%(floors)s: epoch seconds by partition * levels + level, NULL = no floor;
-- see queue_manager/manager/floors.py). Also returns the database clock, so the manager can fire by
-- the database's time.
SELECT e.id, e.tenant, e.partition, extract(epoch FROM e.fire_at)::double precision AS fire_at,
       extract(epoch FROM clock_timestamp())::double precision AS db_now, e.priority, e.concurrency_key, e.rate_key
  FROM (SELECT s.*, row_number() OVER (PARTITION BY s.partition ORDER BY s.fire_at, s.id) AS n
          FROM unnest(%(parts)s::smallint[]) AS p(part)
         CROSS JOIN generate_series(1, %(levels)s) AS lv(v)
         CROSS JOIN LATERAL (
                SELECT q.id, q.tenant, q.partition, q.fire_at, q.priority, q.concurrency_key, q.rate_key
                  FROM {queue} q
                 WHERE q.partition = p.part AND q.priority = lv.v AND q.state = 'to_be_fired'
                   AND q.fire_at <= now() + make_interval(secs => %(window)s)
                   AND q.fire_at > CASE WHEN %(future_only)s THEN now()
                                        ELSE coalesce(to_timestamp((%(floors)s::double precision[])[p.part * %(levels)s + lv.v]),
                                                      '-infinity'::timestamptz) END
                 ORDER BY q.fire_at
                 LIMIT %(quota)s) s) e
 WHERE e.n <= %(quota)s
 ORDER BY e.partition, e.fire_at

-- mgr_db_now --
SELECT extract(epoch FROM clock_timestamp())::double precision

-- mgr_fire --
-- Mark due events fired (attempt + 1, ack deadline) under the current term; only the rows returned
-- were fired and may be pushed (with their trace context and priority, for the delivery frame, and
-- their keys, for the limits). fire_at <= now() keeps "never early" by the database clock. A
-- paused queue fires nothing: a statement that starts after the pause commits sees it.
UPDATE {queue} q
   SET state = 'fired', attempts = q.attempts + 1, fired_at = now(),
       ack_deadline = now() + make_interval(secs => %(ack_timeout)s), fired_term = f.term
  FROM (SELECT qm.fence(%(term)s) AS term, (SELECT paused FROM qm.queues WHERE id = %(queue_id)s) AS paused) f
 WHERE q.id = ANY(%(ids)s::bigint[]) AND q.state::text = 'to_be_fired' AND q.fire_at <= now() AND f.paused IS FALSE
RETURNING q.id, q.tenant, q.partition, q.attempts, extract(epoch FROM q.fire_at)::double precision, q.payload::text,
          q.traceparent, q.tracestate, q.baggage, q.priority, q.concurrency_key, q.rate_key

-- mgr_fire_due --
-- Fire what is due now without a prior scan (the backlog and wake-up path, for queues whose
-- receivers all take every tenant and that have no tenant or key limits), stream by stream:
-- * the streams: each partition's priority levels (%(levels)s of them), each read in fire_at order
--   from its floor (%(floors)s, epoch seconds by partition * levels + level, NULL = none: the index
--   range scan then starts after what is known fired, not at the dead entries of everything fired
--   since the last vacuum), up to its cap (%(caps)s, by the same index; NULL: %(quota)s);
-- * walked by the levels' counts, the lowest first (%(counts)s: each level's, by level; the
--   manager's, from the levels' oldest events and their aging: queue_manager/manager/priority.py),
--   then, behind a backlog (%(since)s: the previous pick's time, epoch seconds; NULL: none), the
--   streams whose earliest due event is not older than it first (they had nothing due then: a quiet
--   tenant's event waits for one pick, as fq_codel serves new flows before old ones; docs/design.md,
--   "Fair dispatch between tenants"), then the level (%(ties)s: which of the levels that count the
--   same goes first, rotating pick by pick), then round-robin from %(start)s; so aging never
--   reorders the events of one level, and levels of one count take turns;
-- * each stream's rows are locked as they are read (SKIP LOCKED: a row an application holds is
--   passed over) and the walk stops at %(limit)s rows: nothing is sorted; they are fired by primary
--   key. A paused queue picks and fires nothing.
-- Behind a backlog each stream's head is probed first (for the order above); the last column (the
-- same on every row) is each level's oldest due event probed (epoch seconds, NULL: none probed),
-- from which, with the rows fired, the manager counts the levels of the next pick.
WITH f AS (SELECT qm.fence(%(term)s) AS term, (SELECT paused FROM qm.queues WHERE id = %(queue_id)s) AS paused),
     walk AS MATERIALIZED (
        SELECT w.p, w.v, w.low, pr.first
          FROM (SELECT (%(start)s + g.i) %% %(partitions)s AS p, g.i, lv.v,
                       coalesce(to_timestamp((%(floors)s::double precision[])[((%(start)s + g.i) %% %(partitions)s) * %(levels)s + lv.v]),
                                '-infinity'::timestamptz) AS low
                  FROM generate_series(0, %(partitions)s - 1) AS g(i) CROSS JOIN generate_series(1, %(levels)s) AS lv(v)) w
          LEFT JOIN LATERAL (
                SELECT q.fire_at AS first FROM {queue} q
                 WHERE %(since)s::double precision IS NOT NULL
                   AND q.partition = w.p AND q.priority = w.v AND q.state = 'to_be_fired' AND q.fire_at <= now()
                   AND q.fire_at >= w.low
                 ORDER BY q.fire_at
                 LIMIT 1) pr ON true
         ORDER BY (%(counts)s::integer[])[w.v], coalesce(pr.first >= to_timestamp(%(since)s::double precision), false) DESC,
                  (%(ties)s::integer[])[w.v], w.i),
     pick AS MATERIALIZED (
        SELECT e.id
          FROM f, walk w
         CROSS JOIN LATERAL (
                SELECT q.id FROM {queue} q
                 WHERE q.partition = w.p AND q.priority = w.v AND q.state = 'to_be_fired'
                   AND q.fire_at <= now() AND q.fire_at >= w.low
                 ORDER BY q.fire_at
                 LIMIT coalesce((%(caps)s::integer[])[w.p * %(levels)s + w.v], %(quota)s)
                   FOR UPDATE SKIP LOCKED) e
         WHERE f.paused IS FALSE
         LIMIT %(limit)s)
UPDATE {queue} q
   SET state = 'fired', attempts = q.attempts + 1, fired_at = now(),
       ack_deadline = now() + make_interval(secs => %(ack_timeout)s), fired_term = f.term
  FROM f
 WHERE q.id = ANY(ARRAY(SELECT id FROM pick)) AND q.state::text = 'to_be_fired'
RETURNING q.id, q.tenant, q.partition, q.attempts, extract(epoch FROM q.fire_at)::double precision, q.payload::text,
          q.traceparent, q.tracestate, q.baggage, q.priority, q.concurrency_key, q.rate_key,
          (SELECT array_agg(extract(epoch FROM (SELECT min(w.first) FROM walk w WHERE w.v = lv.v))::double precision
                            ORDER BY lv.v)
             FROM generate_series(1, %(levels)s) AS lv(v))

-- mgr_fire_due_fair --
-- mgr_fire_due for a queue with tenant settings (queue_manager/manager/fairness.py) or key limits
-- (queue_manager/manager/keys.py): the same streams (each partition's priority levels, %(levels)s of
-- them, walked from %(start)s, each from its floor in %(floors)s), without locks, taking per stream at
-- most %(quota)s candidates among its first %(window)s due rows that are not of a tenant at its cap
-- (%(capped)s) nor of a concurrency key or a rate key at its limit (%(cblocked)s, %(rblocked)s:
-- tenant || chr(31) || key); the window bounds how far a pick looks past the events held back
-- (no head-of-line blocking within it); at most %(candidates)s in all. The levels go by their count
-- (%(counts)s), levels of one count taking turns (%(ties)s), as in mgr_fire_due. Each candidate gets
-- its start tag: its tenant's offset ahead of the virtual time (%(ahead)s, 0 when not listed) + (its
-- rank among its tenant's candidates, by count, its turn in its level (fire_at order), ties - 1) /
-- the tenant's weight (1 when not listed); a tenant takes at most its room (%(rooms)s, else
-- %(default_room)s, NULL = no cap), a concurrency key at most its room (%(crooms)s, else
-- %(cdefault)s) and a rate key at most its room (%(rrooms)s, else %(rdefault)s). The %(limit)s first by
-- level, then tag (ties in walk order) are locked (SKIP LOCKED) and fired by primary key. A paused
-- queue picks and fires nothing. The last two columns count the candidates seen and give each level's
-- oldest candidate (as mgr_fire_due's last column).
WITH f AS (SELECT qm.fence(%(term)s) AS term, (SELECT paused FROM qm.queues WHERE id = %(queue_id)s) AS paused),
     seen AS MATERIALIZED (
        SELECT e.id, e.tenant, e.fire_at, e.ckey, e.rkey, g.i AS turn, lv.v
          FROM f, generate_series(0, %(partitions)s - 1) AS g(i) CROSS JOIN generate_series(1, %(levels)s) AS lv(v)
         CROSS JOIN LATERAL (
                SELECT s.id, s.tenant, s.fire_at, s.ckey, s.rkey
                  FROM (SELECT q.id, q.tenant, q.fire_at,
                               q.tenant || chr(31) || q.concurrency_key AS ckey, q.tenant || chr(31) || q.rate_key AS rkey
                          FROM {queue} q
                         WHERE q.partition = (%(start)s + g.i) %% %(partitions)s AND q.priority = lv.v
                           AND q.state = 'to_be_fired' AND q.fire_at <= now()
                           AND q.fire_at >= coalesce(to_timestamp((%(floors)s::double precision[])[((%(start)s + g.i) %% %(partitions)s) * %(levels)s + lv.v]),
                                                     '-infinity'::timestamptz)
                         ORDER BY q.fire_at
                         LIMIT %(window)s) s
                 WHERE s.tenant <> ALL(%(capped)s::text[])
                   AND (s.ckey IS NULL OR s.ckey <> ALL(%(cblocked)s::text[]))
                   AND (s.rkey IS NULL OR s.rkey <> ALL(%(rblocked)s::text[]))
                 LIMIT %(quota)s) e
         WHERE f.paused IS FALSE
         LIMIT %(candidates)s),
     levels AS (
        SELECT r.*, (%(counts)s::integer[])[r.v] AS lr, (%(ties)s::integer[])[r.v] AS tie,
               row_number() OVER (PARTITION BY r.tenant, r.v ORDER BY r.fire_at, r.id) AS lt
          FROM seen r),
     ranked AS (
        SELECT r.*,
               row_number() OVER (PARTITION BY r.tenant ORDER BY r.lr, r.lt, r.tie) AS j,
               CASE WHEN r.ckey IS NULL THEN 1
                    ELSE row_number() OVER (PARTITION BY r.ckey ORDER BY r.lr, r.lt, r.tie) END AS cj,
               CASE WHEN r.rkey IS NULL THEN 1
                    ELSE row_number() OVER (PARTITION BY r.rkey ORDER BY r.lr, r.lt, r.tie) END AS rj
          FROM levels r),
     tagged AS (
        SELECT r.id, r.turn, r.fire_at, r.lr, coalesce(t.ahead, 0) + (r.j - 1) / coalesce(t.weight, 1) AS tag
          FROM ranked r
          LEFT JOIN unnest(%(tenants)s::text[], %(ahead)s::double precision[], %(weights)s::double precision[],
                           %(rooms)s::integer[]) AS t(tenant, ahead, weight, room) ON t.tenant = r.tenant
          LEFT JOIN unnest(%(ckeys)s::text[], %(crooms)s::integer[]) AS ck(key, room) ON ck.key = r.ckey
          LEFT JOIN unnest(%(rkeys)s::text[], %(rrooms)s::integer[]) AS rk(key, room) ON rk.key = r.rkey
         WHERE r.j <= coalesce(t.room, %(default_room)s::integer, 2147483647)
           AND (r.ckey IS NULL OR r.cj <= coalesce(ck.room, %(cdefault)s::integer, 2147483647))
           AND (r.rkey IS NULL OR r.rj <= coalesce(rk.room, %(rdefault)s::integer, 2147483647))),
     chosen AS MATERIALIZED (SELECT id FROM tagged ORDER BY lr, tag, turn, fire_at LIMIT %(limit)s),
     locked AS MATERIALIZED (
        SELECT q.id FROM {queue} q
         WHERE q.id = ANY(ARRAY(SELECT id FROM chosen)) AND q.state::text = 'to_be_fired'
           FOR UPDATE SKIP LOCKED)
UPDATE {queue} q
   SET state = 'fired', attempts = q.attempts + 1, fired_at = now(),
       ack_deadline = now() + make_interval(secs => %(ack_timeout)s), fired_term = f.term
  FROM f
 WHERE q.id = ANY(ARRAY(SELECT id FROM locked)) AND q.state::text = 'to_be_fired' AND q.fire_at <= now()
RETURNING q.id, q.tenant, q.partition, q.attempts, extract(epoch FROM q.fire_at)::double precision, q.payload::text,
          q.traceparent, q.tracestate, q.baggage, q.priority, q.concurrency_key, q.rate_key,
          (SELECT count(*) FROM seen)::integer,
          (SELECT array_agg(extract(epoch FROM (SELECT min(s.fire_at) FROM seen s WHERE s.v = lv.v))::double precision
                            ORDER BY lv.v)
             FROM generate_series(1, %(levels)s) AS lv(v))

-- mgr_trace_contexts --
-- The traceparents of some events (a sampled ack or nack batch's span links to them).
SELECT q.traceparent FROM {queue} q WHERE q.id = ANY(%(ids)s::bigint[]) AND q.traceparent IS NOT NULL

-- mgr_ack --
-- fired -> acked for (id, attempt) pairs still fired at that attempt; bumps the done counters.
-- q.id = ANY(ids) lets the planner probe the primary key (a join on unnest alone may plan a
-- sequential scan of the whole table).
WITH f AS (SELECT qm.fence(%(term)s) AS term),
     done AS (
        UPDATE {queue} q SET state = 'acked', acked_at = now(), ack_deadline = NULL
          FROM f, unnest(%(ids)s::bigint[], %(attempts)s::integer[]) AS a(id, attempt)
         WHERE q.id = ANY(%(ids)s::bigint[]) AND q.id = a.id AND q.attempts = a.attempt AND q.state::text = 'fired'
        RETURNING q.id, q.partition)
SELECT coalesce(array_agg(id), ARRAY[]::bigint[]), qm.add_done(%(queue_id)s, coalesce(array_agg(partition), ARRAY[]::smallint[]))::text FROM done

-- mgr_ack_delete --
-- mgr_ack for a queue without retention (retention_seconds = 0, docs/operations.md, "Delete on
-- ack"): the acked event is deleted, not updated to acked. A DELETE writes no new row version and
-- no index entry (an UPDATE to acked writes both, a non-HOT version with its primary-key and
-- <queue>_acked entries, and the retention purge deletes that version later), so an event costs
-- its insert, its fire and this delete. The same guard and the same counters as mgr_ack.
WITH f AS (SELECT qm.fence(%(term)s) AS term),
     done AS (
        DELETE FROM {queue} q
         USING f, unnest(%(ids)s::bigint[], %(attempts)s::integer[]) AS a(id, attempt)
         WHERE q.id = ANY(%(ids)s::bigint[]) AND q.id = a.id AND q.attempts = a.attempt AND q.state::text = 'fired'
        RETURNING q.id, q.partition)
SELECT coalesce(array_agg(id), ARRAY[]::bigint[]), qm.add_done(%(queue_id)s, coalesce(array_agg(partition), ARRAY[]::smallint[]))::text FROM done

-- mgr_release --
-- fired -> to_be_fired (or failed at max attempts) for (id, attempt) pairs: nacks and the events of
-- a receiver that went away. delay NULL means the queue's back-off; error is kept as last_error.
WITH f AS (SELECT qm.fence(%(term)s) AS term),
     moved AS (
        UPDATE {queue} q
           SET state = CASE WHEN q.attempts >= %(max_attempts)s THEN 'failed' ELSE 'to_be_fired' END::qm.event_state,
               fire_at = CASE WHEN q.attempts >= %(max_attempts)s THEN q.fire_at
                              ELSE now() + make_interval(secs => coalesce(a.delay, qm.backoff_seconds(q.attempts, %(backoff_min)s, %(backoff_max)s))) END,
               ack_deadline = NULL, last_error = a.error
          FROM f, unnest(%(ids)s::bigint[], %(attempts)s::integer[], %(delays)s::double precision[], %(errors)s::text[])
               AS a(id, attempt, delay, error)
         WHERE q.id = ANY(%(ids)s::bigint[]) AND q.id = a.id AND q.attempts = a.attempt AND q.state::text = 'fired'
        RETURNING q.id, q.partition, q.state)
SELECT coalesce(array_agg(id), ARRAY[]::bigint[]), coalesce(array_agg(id) FILTER (WHERE state = 'failed'), ARRAY[]::bigint[]),
       qm.add_done(%(queue_id)s, coalesce(array_agg(partition) FILTER (WHERE state = 'failed'), ARRAY[]::smallint[]))::text,
       extract(epoch FROM now())::double precision
  FROM moved

-- mgr_in_hand --
-- Which of the given (id, attempt) deliveries the queue still has fired at that attempt. A session
-- asks this of its ledger's deliveries when it starts, after LISTEN: one that was settled while no
-- session listened (an ack by SQL whose qm_settled notice reached nobody) is no longer in hand.
SELECT q.id
  FROM {queue} q, unnest(%(ids)s::bigint[], %(attempts)s::integer[]) AS a(id, attempt)
 WHERE q.id = ANY(%(ids)s::bigint[]) AND q.id = a.id AND q.attempts = a.attempt AND q.state::text = 'fired'

-- mgr_fired_keys --
-- The fired events that have a concurrency key, by the fired index (as many as are in flight): a
-- new session counts those it does not hold for their keys before its first pick, so that a
-- failover never admits more of a key than its limit (queue_manager/manager/keys.py).
SELECT q.id, q.attempts, q.tenant, q.concurrency_key
  FROM {queue} q
 WHERE q.state = 'fired' AND q.concurrency_key IS NOT NULL

-- mgr_fired_in_term --
-- The events fired under this term, (id, attempt), by the fired index (as many as are in flight): a
-- session that starts again under the term of the one that failed releases at once those its
-- receivers do not hold: fires that committed while their answer was lost with the failed
-- session's connection (a link reset). Left to the collector, each waited its ack deadline.
SELECT q.id, q.attempts
  FROM {queue} q
 WHERE q.state = 'fired' AND q.fired_term = %(term)s

-- mgr_settled --
-- Events an application settled by SQL (acked, dead-lettered or deleted while fired): count them
-- done, one partition entry per event.
SELECT qm.add_done(%(queue_id)s, %(parts)s::smallint[]) FROM (SELECT qm.fence(%(term)s)) f

-- mgr_wake_lock_probe --
-- Which queues' wake-up locks are held at this instant, and the database clock at the statement's
-- start (before any lock is tried: a reading's time must precede what it saw): a lock that is free
-- (the exclusive try succeeds; it is given back at once, in the same row) has no holder. Reading
-- pg_locks and pg_stat_activity (mgr_wake_lock_holders) snapshots the whole lock table and every
-- backend: 2.5 ms a reading in a busy drain, 100 readings a second, a quarter of the drain's speed.
-- A producer that tries the shared lock in the instant it is held here fails its try and notifies.
SELECT p.q,
       CASE WHEN pg_try_advisory_lock(qm.lock_class('wake'), p.q)
            THEN NOT pg_advisory_unlock(qm.lock_class('wake'), p.q) ELSE true END,
       extract(epoch FROM statement_timestamp())::double precision
  FROM unnest(%(ids)s::integer[]) AS p(q)

-- mgr_wake_lock_holders --
-- Producer transactions holding a queue's wake-up lock in shared mode (they did not notify), with
-- their start (epoch seconds), and the database clock of this reading: the statement's start, which
-- precedes the lock table's snapshot (clock_timestamp() after the snapshot could follow a producer
-- that took the lock after it by more than floors.HOLDER_MARGIN on a loaded server). A
-- transaction caught while it commits shows no start any more (NULL): floors.HolderWatch.read
-- bounds its rows.
SELECT l.objid::integer AS queue_id, l.pid,
       extract(epoch FROM a.xact_start)::double precision,
       extract(epoch FROM statement_timestamp())::double precision
  FROM pg_locks l
  JOIN pg_stat_activity a ON a.pid = l.pid
 WHERE l.locktype = 'advisory' AND l.classid = qm.lock_class('wake') AND l.objsubid = 2 AND l.mode = 'ShareLock'
   AND l.granted AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND l.objid::integer = ANY(%(ids)s::integer[])
UNION ALL
SELECT NULL, NULL, NULL, extract(epoch FROM statement_timestamp())::double precision

-- mgr_extend --
-- Push the ack deadline of (id, attempt) pairs still fired at that attempt to now + seconds.
WITH f AS (SELECT qm.fence(%(term)s) AS term)
UPDATE {queue} q SET ack_deadline = now() + make_interval(secs => a.seconds)
  FROM f, unnest(%(ids)s::bigint[], %(attempts)s::integer[], %(seconds)s::double precision[]) AS a(id, attempt, seconds)
 WHERE q.id = ANY(%(ids)s::bigint[]) AND q.id = a.id AND q.attempts = a.attempt AND q.state::text = 'fired'
RETURNING q.id, extract(epoch FROM q.ack_deadline)::double precision

-- mgr_sweep --
-- The old-event collector: events left fired past their ack deadline (a receiver that never
-- answered, or a manager that crashed) go back to to_be_fired after the back-off, or to failed
-- at max attempts. Only deadlines from %(resume_at)s on (epoch seconds; NULL = all): the collector
-- starts a little before where its last run stopped, so that it does not walk the dead index
-- entries of every event acked since the last vacuum. SKIP LOCKED pages past rows an application
-- transaction holds (an ack by SQL not yet committed); the ids reach the UPDATE as an array (a
-- primary-key probe), as in mgr_fire_due.
-- The last column is the earliest deadline (epoch seconds) of an overdue fired row from resume_at on
-- that this page did not take, NULL if none: when the page was not full, a row an application
-- holds. The collector's next resume_at stays at or below it, so that the row is looked at again on
-- every run and fired again on the first run after a rollback (the NOT IN is a hashed subplan:
-- one walk of the fired index from resume_at, stopping at the first row not taken).
WITH f AS (SELECT qm.fence(%(term)s) AS term),
     cand AS MATERIALIZED (
        SELECT q.id FROM {queue} q
         WHERE q.state = 'fired' AND q.ack_deadline <= now()
           AND q.ack_deadline >= coalesce(to_timestamp(%(resume_at)s::double precision), '-infinity'::timestamptz)
         ORDER BY q.ack_deadline
         LIMIT %(limit)s
           FOR UPDATE SKIP LOCKED),
     moved AS (
        UPDATE {queue} q
           SET state = CASE WHEN q.attempts >= %(max_attempts)s THEN 'failed' ELSE 'to_be_fired' END::qm.event_state,
               fire_at = CASE WHEN q.attempts >= %(max_attempts)s THEN q.fire_at
                              ELSE now() + make_interval(secs => qm.backoff_seconds(q.attempts, %(backoff_min)s, %(backoff_max)s)) END,
               ack_deadline = NULL,
               last_error = 'no ack before the deadline (attempt ' || q.attempts || ')'
          FROM f
         WHERE q.id = ANY(ARRAY(SELECT id FROM cand)) AND q.state::text = 'fired' AND q.ack_deadline <= now()
        RETURNING q.id, q.partition, q.state)
SELECT coalesce(array_agg(id), ARRAY[]::bigint[]), coalesce(array_agg(id) FILTER (WHERE state = 'failed'), ARRAY[]::bigint[]),
       qm.add_done(%(queue_id)s, coalesce(array_agg(partition) FILTER (WHERE state = 'failed'), ARRAY[]::smallint[]))::text,
       (SELECT count(*) FROM cand), extract(epoch FROM now())::double precision,
       (SELECT extract(epoch FROM h.ack_deadline)::double precision FROM {queue} h
         WHERE h.state = 'fired' AND h.ack_deadline <= now()
           AND h.ack_deadline >= coalesce(to_timestamp(%(resume_at)s::double precision), '-infinity'::timestamptz)
           AND h.id NOT IN (SELECT id FROM cand)
         ORDER BY h.ack_deadline
         LIMIT 1)
  FROM moved

-- mgr_slice_purge --
-- A retention slice: in one partition, delete up to %(limit)s acked events acked more than
-- %(retention)s seconds ago, as many cancelled ones cancelled that long ago (by the <queue>_cancelled
-- index, whose predicate says state > 'failed': cancelled is the enum's last value), and up to
-- %(limit)s failed events whose last fire (their settle time,
-- as in archive.sql) is more than %(failed_retention)s seconds ago (NULL: failed events are kept),
-- oldest first, by the <queue>_acked and <queue>_failed indexes. Rows another transaction holds
-- are skipped, not waited for. Runs on any manager's maintenance connection, leader or standby:
-- it is not fenced, since deleting a settled event is right whoever does it.
-- The DELETE states its own guard: whatever the candidates, it never deletes a live event
-- (to_be_fired or fired), however old. The state is compared as text so that the planner probes
-- the primary key (see the top of this file).
-- Returns the acked (with the cancelled) and failed events deleted, and the largest of the
-- candidate counts (a full page means more may wait in this partition).
WITH acked AS MATERIALIZED (
        SELECT q.id FROM {queue} q
         WHERE q.partition = %(partition)s AND q.state = 'acked'
           AND q.acked_at < now() - make_interval(secs => %(retention)s)
         ORDER BY q.acked_at
         LIMIT %(limit)s
           FOR UPDATE SKIP LOCKED),
     cancelled AS MATERIALIZED (
        SELECT q.id FROM {queue} q
         WHERE q.partition = %(partition)s AND q.state > 'failed'
           AND q.acked_at < now() - make_interval(secs => %(retention)s)
         ORDER BY q.acked_at
         LIMIT %(limit)s
           FOR UPDATE SKIP LOCKED),
     failed AS MATERIALIZED (
        SELECT q.id FROM {queue} q
         WHERE %(failed_retention)s::double precision IS NOT NULL
           AND q.partition = %(partition)s AND q.state = 'failed'
           AND coalesce(q.acked_at, q.fired_at, q.created_at)
               < now() - make_interval(secs => %(failed_retention)s::double precision)
         ORDER BY coalesce(q.acked_at, q.fired_at, q.created_at)
         LIMIT %(limit)s
           FOR UPDATE SKIP LOCKED),
     gone AS (
        DELETE FROM {queue} q
         WHERE q.id = ANY(ARRAY(SELECT id FROM acked UNION ALL SELECT id FROM cancelled UNION ALL SELECT id FROM failed))
           AND q.state::text IN ('acked', 'cancelled', 'failed')
        RETURNING q.state)
SELECT count(*) FILTER (WHERE state <> 'failed'), count(*) FILTER (WHERE state = 'failed'),
       greatest((SELECT count(*) FROM acked), (SELECT count(*) FROM cancelled), (SELECT count(*) FROM failed))
  FROM gone

-- mgr_slice_reconcile --
-- A reconciliation slice: one partition's load re-anchored on its live events, without a lock (see
-- qm.reconcile_partition). Returns {load before, live events}, and the seconds the server spent on
-- it (the target list runs left to right: the count, then the clock).
SELECT qm.reconcile_partition(%(queue)s, %(partition)s),
       extract(epoch FROM clock_timestamp() - statement_timestamp())::float8

-- mgr_count_maintenance --
-- Count a maintenance slice shard-wide: recruited, finished, aborted, or the events it handled.
SELECT qm.count_maintenance(%(job)s, %(what)s, %(n)s)

-- mgr_rate_publish --
-- This manager's lease rows (one per limited queue) into one shard's database: the slices it
-- may use, what it wants, whether a raise is pending. renewed_at is this database's clock. A row
-- of a newer leader term of the same shard is never overwritten (a deposed manager's late write
-- changes nothing); seq grows with every write. Returns how many rows were written.
WITH w AS (
    INSERT INTO qm.rate_leases AS r
           (queue, shard, holder, term, seq, renewed_at, ttl_seconds, resigned,
            want_qps, claim_qps, pending_qps, want_concurrency, claim_concurrency, pending_concurrency)
    SELECT u.queue, %(shard)s, %(holder)s, %(term)s, 1, clock_timestamp(), %(ttl)s, %(resigned)s,
           u.want_qps, u.claim_qps, u.pending_qps, u.want_c, u.claim_c, u.pending_c
      FROM unnest(%(queues)s::text[], %(want_qps)s::double precision[], %(claim_qps)s::double precision[],
                  %(pending_qps)s::boolean[], %(want_c)s::double precision[], %(claim_c)s::double precision[],
                  %(pending_c)s::boolean[])
           AS u(queue, want_qps, claim_qps, pending_qps, want_c, claim_c, pending_c)
    ON CONFLICT (queue, shard) DO UPDATE
       SET holder = EXCLUDED.holder, term = EXCLUDED.term,
           seq = CASE WHEN r.term = EXCLUDED.term THEN r.seq + 1 ELSE 1 END,
           renewed_at = EXCLUDED.renewed_at, ttl_seconds = EXCLUDED.ttl_seconds, resigned = EXCLUDED.resigned,
           want_qps = EXCLUDED.want_qps, claim_qps = EXCLUDED.claim_qps, pending_qps = EXCLUDED.pending_qps,
           want_concurrency = EXCLUDED.want_concurrency, claim_concurrency = EXCLUDED.claim_concurrency,
           pending_concurrency = EXCLUDED.pending_concurrency
     WHERE r.term <= EXCLUDED.term
    RETURNING 1)
SELECT count(*) FROM w

-- mgr_rate_view --
-- The other shards' lease rows of the given queues, as this database holds them, with their
-- liveness judged by this database's own clock (the clock that stamped renewed_at).
SELECT queue, shard, term, seq, resigned, ttl_seconds,
       clock_timestamp() - renewed_at < make_interval(secs => ttl_seconds) AS live,
       want_qps, claim_qps, pending_qps, want_concurrency, claim_concurrency, pending_concurrency
  FROM qm.rate_leases
 WHERE queue = ANY(%(queues)s::text[]) AND shard <> %(shard)s
