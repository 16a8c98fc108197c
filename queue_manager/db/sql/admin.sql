-- The operator actions' statements (queue_manager/admin: the CLI, the dashboard and the admin API
-- call the same ones). Every change is state-guarded: its WHERE clause states the state (and for
-- some the due time) the events must still be in, so an event a manager or another action changed
-- meanwhile is simply not changed; the caller counts what was. Each slice of an action runs in one
-- transaction with its audit row (audit_record).

-- event_filters --
-- Not a statement: the filters of an EventFilter (queue_manager/domain/eventfilter.py) on an event
-- row e, which the queries below (and the event browser's, in web.sql) name by a "filters"
-- placeholder filled with this text. A NULL parameter is no filter (unnamed statements are planned
-- with their values, so a NULL test folds away).
(%(state)s::text IS NULL OR e.state::text = %(state)s::text)
   AND (%(tenant)s::text IS NULL OR e.tenant = %(tenant)s::text)
   AND (%(id)s::bigint IS NULL OR e.id = %(id)s::bigint)
   AND (%(dedup_key)s::text IS NULL OR e.dedup_key = %(dedup_key)s::text)
   AND (%(fire_from)s::timestamptz IS NULL OR e.fire_at >= %(fire_from)s::timestamptz)
   AND (%(fire_to)s::timestamptz IS NULL OR e.fire_at < %(fire_to)s::timestamptz)
   AND (%(created_from)s::timestamptz IS NULL OR e.created_at >= %(created_from)s::timestamptz)
   AND (%(created_to)s::timestamptz IS NULL OR e.created_at < %(created_to)s::timestamptz)
   AND (%(jop)s::text IS NULL
        OR CASE %(jop)s::text
             WHEN 'exists' THEN e.payload #> %(jpath)s::text[] IS NOT NULL
             WHEN '=' THEN e.payload #> %(jpath)s::text[] = %(jvalue)s::jsonb
             ELSE e.payload #> %(jpath)s::text[] <> %(jvalue)s::jsonb
           END)

-- events_pick --
-- The events an action may change: in one of the states %(targets)s, with %(future)s only those not
-- yet due, matching the filter and, when %(ids)s is
-- given, among those ids. Below id %(below)s (NULL: from the newest), newest first, at most
-- %(limit)s.
SELECT e.id, e.created_at
  FROM {queue} e
 WHERE e.state = ANY(%(targets)s::qm.event_state[])
   AND (NOT %(future)s OR e.fire_at > now())
   AND (%(below)s::bigint IS NULL OR e.id < %(below)s::bigint)
   AND (%(ids)s::bigint[] IS NULL OR e.id = ANY(%(ids)s::bigint[]))
   AND {filters}
 ORDER BY e.id DESC
 LIMIT %(limit)s

-- events_count --
-- How many events an action would change now (events_pick's conditions), counted up to %(limit)s.
SELECT count(*) AS n
  FROM (SELECT 1 FROM {queue} e
         WHERE e.state = ANY(%(targets)s::qm.event_state[])
           AND (NOT %(future)s OR e.fire_at > now())
           AND (%(ids)s::bigint[] IS NULL OR e.id = ANY(%(ids)s::bigint[]))
           AND {filters}
         LIMIT %(limit)s) m

-- events_retry --
-- Dead letters back in the queue: a fresh attempt budget, due now. A dead letter counted as done
-- (qm.add_done when it failed): back in the queue it counts as load again, so the enqueue counters
-- of its partition are bumped in the same statement (qm.add_load), as a bulk load's are.
WITH moved AS (
        UPDATE {queue} SET state = 'to_be_fired', attempts = 0, fire_at = now(), last_error = NULL,
               fired_at = NULL, acked_at = NULL, ack_deadline = NULL
         WHERE state = 'failed' AND id = ANY(%(ids)s::bigint[])
        RETURNING id, partition),
     bumped AS (
        SELECT qm.add_load(%(queue)s, array_agg(c.part), array_agg(c.n)) AS done
          FROM (SELECT partition::integer AS part, count(*)::integer AS n FROM moved GROUP BY partition) c
        HAVING count(*) > 0)
SELECT m.id FROM moved m LEFT JOIN bumped b ON true

-- events_wake --
-- The shard's manager woken at the commit of a retry (manager/notices.py: a Poke of the queue),
-- so it fires the events without waiting for its next rescan.
SELECT pg_notify('qm_wake', %(queue)s)

-- events_fire_now --
-- Scheduled events made due now. Only rows still to_be_fired and not yet due change: the manager
-- fires an event only by an UPDATE that finds it to_be_fired and due, so it fires each once; the
-- queue's qm_rescheduled trigger wakes it at commit.
UPDATE {queue} SET fire_at = now()
 WHERE id = ANY(%(ids)s::bigint[]) AND state = 'to_be_fired' AND fire_at > now()
RETURNING id

-- events_reschedule --
-- Events not yet fired moved to %(fire_at)s (earlier or later) and/or to priority %(priority)s
-- (NULL: kept). Only rows still to_be_fired change; a manager that cached one at its old time
-- cannot fire it early: its fire needs fire_at <= now(). The queue's qm_rescheduled trigger (on a
-- change of fire_at or priority) wakes it at commit.
UPDATE {queue}
   SET fire_at = coalesce(%(fire_at)s::timestamptz, fire_at), priority = coalesce(%(priority)s::smallint, priority)
 WHERE id = ANY(%(ids)s::bigint[]) AND state = 'to_be_fired'
RETURNING id

-- events_cancel --
-- Events not yet settled cancelled (qm.cancel: to_be_fired and fired ones become cancelled, the
-- others are left as they are; a fired one's manager hears of it at the commit and tells the
-- receiver holding it). One row: the ids cancelled.
SELECT qm.cancel(%(queue)s, %(ids)s::bigint[], %(reason)s) AS ids

-- audit_record --
-- An action's part on this shard, in the transaction of its change: created by its first slice
-- (or its settings change), then each slice adds what it asked for and what it changed;
-- %(last)s marks the part finished.
INSERT INTO qm.audit AS a (action_id, via, actor, action, queue, filter, plan, requested, affected, finished_at)
VALUES (%(action_id)s, %(via)s, %(actor)s, %(action)s, %(queue)s, %(detail)s, %(plan)s::jsonb, %(asked)s, %(changed)s,
        CASE WHEN %(last)s THEN now() END)
ON CONFLICT (action_id) DO UPDATE
   SET requested = a.requested + excluded.requested,
       affected = a.affected + excluded.affected,
       finished_at = excluded.finished_at

-- audit_recent --
-- The newest parts on this shard (of one queue's actions, or of all), newest first.
SELECT id, at, action_id, via, actor, action, queue, filter, plan, requested, affected, finished_at
  FROM qm.audit
 WHERE %(queue)s::text IS NULL OR queue = %(queue)s::text
 ORDER BY id DESC
 LIMIT %(limit)s

-- audit_action --
-- One action's part on this shard, if it has one.
SELECT id, at, action_id, via, actor, action, queue, filter, plan, requested, affected, finished_at
  FROM qm.audit
 WHERE action_id = %(action_id)s::uuid

-- schedule_add --
-- A periodic schedule added (%(replace)s: or the one of that name changed) on the tenant's shard,
-- by the SQL API's checks (qm.schedule_write). One row: the schedule.
SELECT (qm.schedule_write(%(replace)s, %(name)s, %(queue)s, %(tenant)s, %(payload)s::jsonb, %(cron)s,
                          %(interval)s, %(timezone)s, %(misfire)s, %(catch_up)s, %(priority)s::smallint, %(paused)s,
                          %(anchor)s)).id AS changed

-- schedule_pause --
SELECT (qm.schedule_pause(%(name)s)).id AS changed

-- schedule_resume --
SELECT (qm.schedule_resume(%(name)s)).id AS changed

-- schedule_remove --
SELECT qm.schedule_remove(%(name)s) AS changed

-- schedules_list --
-- A shard's schedules (of one queue, or all; one by name), with their queue's name and the state
-- of their last enqueued slot's event.
SELECT s.id, s.name, q.name AS queue, s.tenant, s.payload, s.priority, s.cron, s.interval_seconds, s.timezone,
       s.anchor, s.paused, s.misfire, s.catch_up, s.next_at, s.last_slot, s.last_event_id, s.missed, s.error,
       s.created_at, s.updated_at, now() AS now
  FROM qm.schedules s JOIN qm.queues q ON q.id = s.queue_id
 WHERE (%(queue)s::text IS NULL OR q.name = %(queue)s::text)
   AND (%(name)s::text IS NULL OR s.name = %(name)s::text)
 ORDER BY s.name
 LIMIT %(limit)s

-- schedule_slot_event --
-- The event of one slot of a schedule (by its dedup key), if it is still there.
SELECT id, state::text AS state, fire_at, fired_at, acked_at, attempts
  FROM {queue}
 WHERE tenant = %(tenant)s AND dedup_key = %(key)s

-- events_list --
-- A page of a queue's events on this shard for `qm events list`, newest first, below id %(below)s
-- (NULL: from the newest), matching the filters, at most %(limit)s (the payload cut to 200
-- characters: `qm events show` gives it whole).
SELECT e.id, e.tenant, e.partition, e.state::text AS state, e.attempts, e.fire_at, e.created_at, e.fired_at,
       e.acked_at, e.dedup_key, e.priority, left(e.payload::text, 200) AS payload, left(e.last_error, 200) AS last_error
  FROM {queue} e
 WHERE (%(below)s::bigint IS NULL OR e.id < %(below)s::bigint)
   AND {filters}
 ORDER BY e.id DESC
 LIMIT %(limit)s

-- event_show --
-- One event, every column.
SELECT id, tenant, partition, state::text AS state, attempts, fire_at, created_at, fired_at, acked_at, ack_deadline,
       fired_term, dedup_key, priority, concurrency_key, rate_key, last_error, traceparent, tracestate, baggage, payload
  FROM {queue}
 WHERE id = %(id)s
