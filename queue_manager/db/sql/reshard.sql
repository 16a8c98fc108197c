-- Runtime queries of a reshard (queue_manager/reshard/workflow.py; docs/operations.md, "Resharding").

-- reshard_lock --
-- One reshard process at a time on a shard (session-level; released when the process ends).
SELECT pg_try_advisory_lock(qm.lock_class('reshard'), 0)

-- reshard_shard --
SELECT name, range_start, range_end, serving, capturing FROM qm.shard

-- reshard_queues --
-- Every queue with its settings (as qm.create_queue takes them), and whether a shrink still drains.
SELECT q.name, (SELECT jsonb_object_agg(k, to_jsonb(q) -> k) FROM unnest(qm.settable_columns()) k),
       q.partitions <> q.partitions_physical
  FROM qm.queues q ORDER BY q.id

-- reshard_queue_names --
SELECT name FROM qm.queues ORDER BY id

-- reshard_create_queue --
SELECT (qm.create_queue(%(name)s, %(settings)s, true)).name

-- reshard_alter_queue --
SELECT (qm.alter_queue(%(name)s, %(settings)s)).name

-- reshard_prepare_target --
SELECT qm.reshard_prepare_target(%(name)s, %(range_start)s, %(range_end)s, %(shards)s::jsonb)

-- reshard_set_capturing --
SELECT qm.set_capturing(%(on)s)

-- reshard_set_serving --
SELECT qm.set_serving(%(state)s, %(shards)s::jsonb)

-- reshard_set_shard_map --
SELECT qm.set_shard_map(%(shards)s::jsonb)

-- reshard_freeze --
-- The freeze of a cut-over: qm.set_serving('frozen'), each of its lock waits bounded by
-- %(timeout)s (lock_timeout, set for this statement's own transaction, before the call runs: a
-- subquery with a volatile function is not pulled up). One round trip.
SELECT qm.set_serving('frozen', %(shards)s::jsonb) FROM (SELECT set_config('lock_timeout', %(timeout)s, true)) AS t

-- reshard_snapshot --
-- The next page of a queue's events after id %(after)s, each as the JSON qm.reshard_apply takes
-- (with home and home_id: where an event copied here from another shard came from).
SELECT e.id, e.tenant, (to_jsonb(e) || jsonb_build_object('home', m.origin, 'home_id', m.origin_id))::text
  FROM {queue} e
  LEFT JOIN qm.reshard_rows m ON m.queue = %(queue)s AND m.local_id = e.id
 WHERE e.id > %(after)s
 ORDER BY e.id
 LIMIT %(limit)s

-- reshard_left --
SELECT count(*) FROM {queue} WHERE id > %(after)s

-- reshard_captured --
-- The oldest captured changes (any order would do: applying re-reads the current row).
SELECT seq, queue, id, tenant FROM qm.reshard_capture ORDER BY seq LIMIT %(limit)s

-- reshard_rows_by_id --
-- The current rows of the given ids (NULL row: gone), as in reshard_snapshot.
SELECT i.id, e.id IS NOT NULL,
       CASE WHEN e.id IS NULL THEN jsonb_build_object('id', i.id, 'home', m.origin, 'home_id', m.origin_id)
            ELSE to_jsonb(e) || jsonb_build_object('home', m.origin, 'home_id', m.origin_id) END::text
  FROM unnest(%(ids)s::bigint[]) AS i(id)
  LEFT JOIN {queue} e ON e.id = i.id
  LEFT JOIN qm.reshard_rows m ON m.queue = %(queue)s AND m.local_id = i.id

-- reshard_apply --
SELECT qm.reshard_apply(%(queue)s, %(origin)s, %(upserts)s::jsonb, %(gone)s::jsonb)

-- reshard_forget_captured --
DELETE FROM qm.reshard_capture WHERE seq = ANY(%(seqs)s::bigint[])

-- reshard_lag --
SELECT count(*) FROM qm.reshard_capture

-- reshard_tenants --
-- Every queue's tenant overrides on this shard, as qm.reshard_sync_tenants takes them.
SELECT q.name,
       coalesce(jsonb_agg(jsonb_build_object('tenant', t.tenant, 'weight', t.weight, 'max_in_flight', t.max_in_flight))
                FILTER (WHERE t.tenant IS NOT NULL), '[]'::jsonb)
  FROM qm.queues q LEFT JOIN qm.tenant_settings t ON t.queue_id = q.id
 GROUP BY q.name

-- reshard_sync_tenants --
SELECT qm.reshard_sync_tenants(%(queue)s, %(range_start)s, %(range_end)s, %(rows)s::jsonb)

-- reshard_origin_marks --
-- A frozen shard's leader term, and the last id each queue's sequence gave out ({queue: id}, null:
-- none yet): a receiving shard's term and sequences go above them (qm.reshard_finish_copy).
SELECT (SELECT term FROM qm.leader),
       (SELECT jsonb_object_agg(q.name, pg_sequence_last_value(pg_get_serial_sequence(format('public.%I', q.name), 'id')::regclass))
          FROM qm.queues q)

-- reshard_finish_copy --
SELECT qm.reshard_finish_copy(%(min_term)s, %(min_ids)s::jsonb)

-- reshard_reconcile --
-- The load counters of every queue equal to its live events per partition (after a copy).
SELECT qm.reconcile_load(name) FROM qm.queues

-- reshard_clear_capture --
DELETE FROM qm.reshard_capture

-- reshard_clear_rows --
DELETE FROM qm.reshard_rows

-- reshard_clear_tenants --
DELETE FROM qm.tenant_settings

-- reshard_truncate_queue --
TRUNCATE {queue}
