-- Runtime queries of `qm queue adopt` (queue_manager/adopt.py), one named block each.
-- Blocks named legacy_* run on the legacy database, the others on a shard. Braces are filled in
-- with psycopg.sql by adopt.py: {table} and {outbox} are schema-qualified identifiers from the
-- catalog, {queue} a checked queue name, and the expressions ({pending}, {problem}, {tenant},
-- {payload}, {fire_at}, {dedup_key}, {marks}) are built from the mapping's column identifiers and
-- named parameters only. The legacy row is `c` wherever an expression reads it.

-- expr_problem --
-- Why the queue would refuse a legacy row (NULL: it would not), by the rules of its routing trigger
-- (docs/sql.md, "What the database refuses"), with the queue's own limits as parameters. The
-- reasons are fixed texts, so that a report can count them.
CASE
    WHEN {tenant} IS NULL OR {tenant} = '' THEN 'tenant is NULL or empty'
    WHEN {payload_source} IS NULL THEN 'payload is NULL'
    WHEN {not_json} THEN 'payload is not JSON'
    WHEN pg_column_size({payload}::text::jsonb) > %(payload_limit)s THEN 'payload over the queue''s payload_limit_bytes'
    WHEN {fire_at} < '2000-01-01' OR NOT isfinite({fire_at}) THEN 'run-at before 2000-01-01 or infinite'
    WHEN {fire_at} > now() + make_interval(secs => %(max_delay)s) THEN 'run-at beyond the queue''s max_delay_seconds'
END

-- expr_not_json --
-- A text payload column: rows whose text is not JSON (PostgreSQL 16 and later).
NOT pg_input_is_valid({column}::text, 'jsonb')

-- expr_run_at_local --
-- A timestamp without time zone, read in the zone the operator named.
({column} AT TIME ZONE %(run_at_timezone)s)

-- expr_payload_object --
-- --payload-cols: one JSON object, keyed by column name.
jsonb_build_object({pairs})

-- legacy_resolve --
-- The legacy table as the search path resolves the name given, and what kind of server holds it.
SELECT n.nspname, c.relname, c.relkind::text AS relkind,
       current_setting('server_version_num')::integer AS server_version,
       current_database() AS database,
       (SELECT system_identifier::text FROM pg_control_system()) AS system_identifier
  FROM pg_class c
  JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE c.oid = to_regclass(%(table)s)

-- legacy_columns --
-- The table's columns, their types, and whether each alone is the key of a unique index.
SELECT a.attname AS name, format_type(a.atttypid, a.atttypmod) AS type, coalesce(b.typname, t.typname) AS typname,
       t.typcategory::text AS category,
       EXISTS (SELECT FROM pg_index i
                WHERE i.indrelid = a.attrelid AND i.indisunique AND i.indisvalid AND i.indpred IS NULL
                  AND i.indnkeyatts = 1 AND i.indkey[0] = a.attnum) AS unique
  FROM pg_attribute a
  JOIN pg_type t ON t.oid = a.atttypid
  LEFT JOIN pg_type b ON t.typtype = 'd' AND b.oid = t.typbasetype
 WHERE a.attrelid = to_regclass(%(table)s) AND a.attnum > 0 AND NOT a.attisdropped
 ORDER BY a.attnum

-- legacy_preflight --
-- Before anything moves: how many rows are pending, and which of them the queue would refuse.
WITH p AS (
    SELECT c.{id}::text AS id, {problem} AS problem FROM {table} c WHERE {pending}
)
SELECT (SELECT count(*) FROM p) AS pending,
       (SELECT count(*) FROM {table}) AS total,
       (SELECT count(*) FROM p WHERE problem IS NOT NULL) AS bad,
       coalesce((SELECT jsonb_object_agg(problem, n) FROM (SELECT problem, count(*) AS n FROM p
                                                            WHERE problem IS NOT NULL GROUP BY problem) g),
                jsonb_build_object()) AS bad_by_reason,
       coalesce((SELECT array_agg(id || ': ' || problem)
                   FROM (SELECT id, problem FROM p WHERE problem IS NOT NULL ORDER BY id LIMIT 10) e),
                ARRAY[]::text[]) AS examples

-- legacy_check_take_delete --
-- Parses and plans the way rows are taken (and checks the privilege to), touching none.
DELETE FROM {table} WHERE false

-- legacy_check_take_mark --
-- The same for marks: a value the column's type refuses fails here, before anything moves.
UPDATE {table} SET {marks} WHERE false

-- legacy_pending_count --
SELECT count(*) FROM {table} c WHERE {pending}

-- legacy_outbox_create --
-- Rows taken out of the legacy table and not yet published, in the legacy database itself, so that
-- taking a row and keeping it are one transaction there. key: never reused (the shards' ledger
-- qm.adopted remembers the keys already published).
CREATE TABLE IF NOT EXISTS {outbox} (
    key        uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    adoption   text NOT NULL,
    legacy_id  text NOT NULL,
    tenant     text NOT NULL,
    payload    jsonb NOT NULL,
    fire_at    timestamptz,
    dedup_key  text,
    moved_at   timestamptz NOT NULL DEFAULT clock_timestamp()
)

-- legacy_outbox_index --
CREATE INDEX IF NOT EXISTS {index} ON {outbox} (adoption, moved_at)

-- legacy_outbox_exists --
SELECT to_regclass(%(outbox)s) IS NOT NULL

-- legacy_move --
-- Phase 1 of a slice, one statement in one transaction: lock up to `limit` pending rows, skipping
-- rows anyone else holds (the old system's consumers); take the good ones out of the legacy queue
-- (legacy_take_delete or legacy_take_mark) and write them, mapped, into the outbox. Rows the queue would refuse stay
-- where they are and come back in bad_ids / bad_reasons. still_pending counts marked rows that
-- still match the filter (the caller rolls back then).
WITH locked AS MATERIALIZED (
    SELECT c.* FROM {table} c
     WHERE {pending} AND NOT (c.{id}::text = ANY(%(skip)s::text[]))
     ORDER BY c.{id}
     LIMIT %(limit)s
       FOR UPDATE OF c SKIP LOCKED
), checked AS MATERIALIZED (
    SELECT c.*, {problem} AS qm_problem FROM locked c
), moved AS (
    {take}
), boxed AS (
    INSERT INTO {outbox} (adoption, legacy_id, tenant, payload, fire_at, dedup_key)
    SELECT %(adoption)s, c.{id}::text, {tenant}, {payload}, {fire_at}, {dedup_key}
      FROM checked c JOIN moved m ON m.id = c.{id}
     ORDER BY c.{id}
    RETURNING 1
)
SELECT (SELECT count(*) FROM locked) AS locked,
       (SELECT count(*) FROM boxed) AS boxed,
       (SELECT count(*) FROM moved WHERE still_pending) AS still_pending,
       coalesce((SELECT array_agg(c.{id}::text ORDER BY c.{id}) FROM checked c WHERE c.qm_problem IS NOT NULL),
                ARRAY[]::text[]) AS bad_ids,
       coalesce((SELECT array_agg(c.qm_problem ORDER BY c.{id}) FROM checked c WHERE c.qm_problem IS NOT NULL),
                ARRAY[]::text[]) AS bad_reasons

-- legacy_take_delete --
DELETE FROM {table} t USING checked c
 WHERE t.{id} = c.{id} AND c.qm_problem IS NULL
RETURNING t.{id} AS id, false AS still_pending

-- legacy_take_mark --
UPDATE {table} t SET {marks} FROM checked c
 WHERE t.{id} = c.{id} AND c.qm_problem IS NULL
RETURNING t.{id} AS id, coalesce({pending_t}, false) AS still_pending

-- legacy_outbox_read --
-- The adoption's rows waiting in the outbox (taken, not yet published), oldest first.
SELECT key, legacy_id, tenant, payload::text AS payload, fire_at, dedup_key
  FROM {outbox}
 WHERE adoption = %(adoption)s AND NOT (key = ANY(%(skip)s::uuid[]))
 ORDER BY moved_at, key
 LIMIT %(limit)s

-- legacy_outbox_delete --
-- Phase 3: the published rows leave the outbox.
DELETE FROM {outbox} WHERE key = ANY(%(keys)s::uuid[])

-- legacy_outbox_count --
SELECT count(*) FROM {outbox} WHERE adoption = %(adoption)s

-- adopt_lock --
-- The same adoption never runs twice at once, whatever legacy database it reads: a session lock on
-- every shard, held for the run. Its class is its own (queue_manager/db/locks.py): it once shared
-- the load lock's class (load, queue id), so an adoption whose name hashed to a queue's id would
-- have held that queue's acks for the whole run.
SELECT pg_try_advisory_lock(qm.lock_class('adopt'), hashtext(%(adoption)s))

-- adopt_ledger_add --
-- Phase 2, on the tenant's shard, in the transaction that inserts the events: remember the outbox
-- keys. The keys that come back are new; the others were published by an earlier run.
INSERT INTO qm.adopted (key, adoption, source, queue, legacy_id)
SELECT u.key, %(adoption)s, %(source)s, %(queue)s, u.legacy_id
  FROM unnest(%(keys)s::uuid[], %(legacy_ids)s::text[]) AS u(key, legacy_id)
    ON CONFLICT (key) DO NOTHING
RETURNING key

-- adopt_insert --
-- Phase 2: a plain INSERT, as a producer's: the routing trigger places each row, every rule checks
-- it, and the verify trigger wakes a waiting manager. No row back for a dedup hit.
INSERT INTO {queue} (tenant, payload, fire_at, dedup_key)
SELECT u.tenant, u.payload::jsonb, coalesce(u.fire_at, clock_timestamp()), u.dedup_key
  FROM unnest(%(tenants)s::text[], %(payloads)s::text[], %(fire_ats)s::timestamptz[], %(dedup_keys)s::text[])
       WITH ORDINALITY AS u(tenant, payload, fire_at, dedup_key, n)
 ORDER BY u.n
RETURNING id

-- adopt_ledger_forget --
-- After the outbox rows are gone (phase 3 committed), their keys are no longer needed.
DELETE FROM qm.adopted WHERE key = ANY(%(keys)s::uuid[])

-- adopt_ledger_sweep --
-- At the start of a run, once the outbox holds no published row (the run holds the adoption's lock):
-- the keys a crash left in the ledger, except those still in the outbox.
DELETE FROM qm.adopted
 WHERE adoption = %(adoption)s AND source = %(source)s AND NOT (key = ANY(%(keep)s::uuid[]))

-- adopt_queue_limits --
SELECT payload_limit_bytes, max_delay_seconds FROM qm.queues WHERE name = %(queue)s
