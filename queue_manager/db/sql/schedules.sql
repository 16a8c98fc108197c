-- The leader's statements for periodic schedules (queue_manager/manager/schedules.py). One pass is
-- one transaction: schedules_fence first (qm.fence's KEY SHARE lock on the leader row lasts to the
-- commit, so a takeover waits for the pass and every later statement of an old term fails), then
-- the schedules due, the slot events and the cursors, committed together: a slot is enqueued, and
-- its schedule's cursor moved past it, or neither.

-- schedules_fence --
SELECT qm.fence(%(term)s) AS fenced, clock_timestamp() AS now

-- schedules_due --
-- Schedules whose next slot falls within their queue's window plus %(ahead)s seconds, locked (a
-- pause, change or removal waits for this pass; a schedule being changed is skipped until the next).
SELECT s.id, s.name, q.name AS queue, q.window_seconds, s.tenant, s.payload::text AS payload, s.cron,
       s.interval_seconds, s.timezone, s.anchor, s.misfire, s.catch_up, s.priority, s.next_at
  FROM qm.schedules s JOIN qm.queues q ON q.id = s.queue_id
 WHERE NOT s.paused AND s.error IS NULL AND (%(only)s::bigint IS NULL OR s.id = %(only)s::bigint)
   AND s.next_at <= %(now)s::timestamptz + make_interval(secs => q.window_seconds + %(ahead)s)
 ORDER BY s.next_at
 LIMIT %(limit)s
   FOR UPDATE OF s SKIP LOCKED

-- schedules_placement --
-- What placing a queue's slot events needs: N, k, the producers' load of each partition
-- (qm.partition_loads, from sequences: no scan), and the priority of a schedule that gives none.
SELECT q.partitions, q.shuffle, qm.partition_loads(q.name) AS loads, q.default_priority
  FROM qm.queues q WHERE q.name = %(queue)s

-- schedules_insert --
-- The slots' events, placed by the leader in the least-loaded partition of their tenant's shuffle
-- set (as a bulk load does: the queue's qm_verify trigger checks every rule of the rows), with
-- ON CONFLICT on the dedup index: a (tenant, dedup key) that exists already makes its row do
-- nothing, so no slot is enqueued twice. No routing trigger and no advisory lock per row (a routed
-- insert takes one to its commit): a slot costs an index insert and the statement's checks. Each
-- event has its schedule's priority, or the queue's default_priority when the schedule gives none.
INSERT INTO {queue} (tenant, partition, payload, fire_at, dedup_key, priority)
SELECT u.tenant, u.partition, u.payload::jsonb, u.fire_at, u.dedup_key, coalesce(u.priority, %(default_priority)s)
  FROM unnest(%(tenants)s::text[], %(partitions)s::smallint[], %(payloads)s::text[], %(fire_ats)s::timestamptz[],
              %(keys)s::text[], %(priorities)s::smallint[]) AS u(tenant, partition, payload, fire_at, dedup_key, priority)
    ON CONFLICT (tenant, dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING
RETURNING id, dedup_key, partition

-- schedules_load --
-- The inserted slot events counted in their partitions' enqueue counters, as a bulk load's are.
SELECT qm.add_load(%(queue)s, %(partitions)s::integer[], %(counts)s::integer[])

-- schedules_advance --
-- The cursors: slots before next_at are enqueued (or skipped by the misfire policy).
UPDATE qm.schedules s
   SET next_at = u.next_at,
       last_slot = coalesce(u.last_slot, s.last_slot),
       last_event_id = coalesce(u.last_event_id, s.last_event_id),
       missed = s.missed + u.missed
  FROM unnest(%(ids)s::bigint[], %(next_ats)s::timestamptz[], %(last_slots)s::timestamptz[],
              %(last_events)s::bigint[], %(missed)s::bigint[]) AS u(id, next_at, last_slot, last_event_id, missed)
 WHERE s.id = u.id

-- schedules_error --
-- A schedule the leader cannot enqueue (a definition its parser refuses, an event the queue
-- refuses): recorded, and left out until a change clears it (qm.schedule_upsert).
UPDATE qm.schedules SET error = left(%(error)s, 1000), updated_at = now() WHERE id = %(id)s
