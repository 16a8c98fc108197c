-- Revision 0009: maintenance in small slices that any manager of the shard may take (work stealing).
--
--   qm.queues.failed_retention_seconds
--                          dead letters (failed events) are deleted this long after they failed
--                          (their last fire stands in for the failure time, as in archive.sql);
--                          NULL keeps them until `qm events retry` or a manual delete. New queues
--                          default to 30 days; queues that exist when this revision runs get NULL,
--                          so that nothing they kept so far starts to go.
--   qm.settable_columns(), qm.write_settings()
--                          know the new setting
--   qm.create_queue()      the same as revision 0001's, except for the retention indexes:
--                          <queue>_acked is (partition, acked_at) and <queue>_failed is new, so that
--                          a slice purges one partition by an index range scan. Existing queues get
--                          the same indexes at the end (a CREATE INDEX each: on a large queue table
--                          it holds back writes to that table while it builds).
--   qm.load_lock_key()     the advisory lock that serialises a queue's done counters: qm.add_done
--                          (the manager's ack statements) waits for it, a reconciliation slice only
--                          tries it, so a slice never overwrites an ack's count with a stale one
--   qm.add_done()          takes that lock (one per statement, not per partition)
--   qm.reconcile_partition()  one partition's load re-anchored on its live events: the slice of the
--                          load reconciliation, safe from any manager process (leader or standby)
--   qm.reconcile_load()    takes the lock too (it is the whole queue's reconciliation)
--   qm.count_maintenance(), qm.maintenance_counts()
--                          how many slices each job recruited, finished and aborted, and the events
--                          they handled, shard-wide, in sequences: a count is an update in place,
--                          without a row version, a dead tuple or a row lock (as the done counters
--                          since revision 0004), and it is not rolled back with an aborted slice

-- ---------------------------------------------------------------- the failed events' retention

ALTER TABLE qm.queues
    ADD COLUMN failed_retention_seconds double precision
        CHECK (failed_retention_seconds IS NULL OR failed_retention_seconds >= 0);
ALTER TABLE qm.queues ALTER COLUMN failed_retention_seconds SET DEFAULT 2592000;

COMMENT ON COLUMN qm.queues.failed_retention_seconds IS
    'failed events are deleted this long after their last fire; NULL keeps them';

CREATE OR REPLACE FUNCTION qm.settable_columns() RETURNS text[]
LANGUAGE sql IMMUTABLE
RETURN ARRAY['partitions', 'shuffle', 'window_seconds', 'cache_size', 'ack_timeout_seconds',
             'backoff_min_seconds', 'backoff_max_seconds', 'max_attempts', 'max_qps', 'max_concurrency',
             'retention_seconds', 'failed_retention_seconds', 'payload_limit_bytes', 'max_delay_seconds',
             'paused'];

CREATE OR REPLACE FUNCTION qm.write_settings(queue_id integer, settings jsonb) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM qm.check_settings(settings);
    UPDATE qm.queues SET
        partitions          = coalesce((settings->>'partitions')::integer, partitions),
        partitions_physical = greatest(coalesce((settings->>'partitions')::integer, partitions), partitions_physical),
        shuffle             = coalesce((settings->>'shuffle')::integer, shuffle),
        window_seconds      = coalesce((settings->>'window_seconds')::double precision, window_seconds),
        cache_size          = coalesce((settings->>'cache_size')::integer, cache_size),
        ack_timeout_seconds = coalesce((settings->>'ack_timeout_seconds')::double precision, ack_timeout_seconds),
        backoff_min_seconds = coalesce((settings->>'backoff_min_seconds')::double precision, backoff_min_seconds),
        backoff_max_seconds = coalesce((settings->>'backoff_max_seconds')::double precision, backoff_max_seconds),
        max_attempts        = coalesce((settings->>'max_attempts')::integer, max_attempts),
        max_qps             = CASE WHEN settings ? 'max_qps' THEN (settings->>'max_qps')::double precision ELSE max_qps END,
        max_concurrency     = CASE WHEN settings ? 'max_concurrency' THEN (settings->>'max_concurrency')::integer ELSE max_concurrency END,
        retention_seconds   = coalesce((settings->>'retention_seconds')::double precision, retention_seconds),
        failed_retention_seconds = CASE WHEN settings ? 'failed_retention_seconds'
                                        THEN (settings->>'failed_retention_seconds')::double precision
                                        ELSE failed_retention_seconds END,
        payload_limit_bytes = coalesce((settings->>'payload_limit_bytes')::integer, payload_limit_bytes),
        max_delay_seconds   = coalesce((settings->>'max_delay_seconds')::double precision, max_delay_seconds),
        paused              = coalesce((settings->>'paused')::boolean, paused),
        updated_at          = now()
    WHERE id = queue_id;
END
$$;

-- ---------------------------------------------------------------- the retention indexes

-- The indexes a retention slice reads: acked events of one partition by ack time, and failed
-- events of one partition by their settle time (the expression archive.sql uses). Both partial,
-- so neither holds a live event.
CREATE FUNCTION qm.create_retention_indexes(queue_name text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    t text := format('public.%I', queue_name);
BEGIN
    EXECUTE format('CREATE INDEX %I ON %s (partition, acked_at) WHERE state = ''acked''', queue_name || '_acked', t);
    EXECUTE format('CREATE INDEX %I ON %s (partition, (coalesce(acked_at, fired_at, created_at))) '
                   'WHERE state = ''failed''', queue_name || '_failed', t);
END
$$;

-- Create a queue on this shard: registry row, table, indexes, triggers, constraints, counters.
-- Revision 0001's function, with the retention indexes of qm.create_retention_indexes.
CREATE OR REPLACE FUNCTION qm.create_queue(queue_name text, settings jsonb DEFAULT '{}', if_not_exists boolean DEFAULT false)
RETURNS qm.queues
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
    t text;
BEGIN
    IF queue_name IS NULL OR queue_name !~ '^[a-z][a-z0-9_]{0,39}$' OR queue_name LIKE 'qm\_%' THEN
        RAISE EXCEPTION 'invalid queue name %: use 1-40 lowercase letters, digits or _, starting with a letter, not starting with qm_',
            quote_nullable(queue_name) USING ERRCODE = '42602';
    END IF;
    SELECT * INTO q FROM qm.queues WHERE name = queue_name;
    IF FOUND THEN
        IF if_not_exists THEN
            RETURN q;
        END IF;
        RAISE EXCEPTION 'queue "%" already exists on this shard', queue_name USING ERRCODE = '42P07';
    END IF;
    IF to_regclass(format('public.%I', queue_name)) IS NOT NULL THEN
        RAISE EXCEPTION 'a table named "%" already exists in schema public and is not a queue', queue_name
            USING ERRCODE = '42P07';
    END IF;
    PERFORM qm.check_settings(settings);

    INSERT INTO qm.queues (name) VALUES (queue_name) RETURNING id INTO q.id;
    PERFORM qm.write_settings(q.id, settings);
    UPDATE qm.queues SET partitions_physical = partitions WHERE id = q.id RETURNING * INTO q;

    t := format('public.%I', queue_name);
    EXECUTE format($ddl$
        CREATE TABLE %1$s (
            id           bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
            tenant       text NOT NULL,
            partition    smallint NOT NULL,
            fire_at      timestamptz NOT NULL DEFAULT now(),
            state        qm.event_state NOT NULL DEFAULT 'to_be_fired',
            attempts     integer NOT NULL DEFAULT 0,
            payload      jsonb NOT NULL DEFAULT '{}',
            dedup_key    text,
            created_at   timestamptz NOT NULL DEFAULT now(),
            fired_at     timestamptz,
            acked_at     timestamptz,
            ack_deadline timestamptz,
            fired_term   bigint,
            last_error   text
        ) WITH (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02)$ddl$, t);
    EXECUTE format('COMMENT ON TABLE %s IS %L', t, 'qm queue; INSERT INTO ' || queue_name || ' (tenant, payload[, fire_at, dedup_key])');
    -- due events of a partition in fire order (window scans, per-partition round robin)
    EXECUTE format('CREATE INDEX %I ON %s (partition, fire_at) WHERE state = ''to_be_fired''', queue_name || '_due', t);
    -- fired events by ack deadline (re-fire, old-event collector)
    EXECUTE format('CREATE INDEX %I ON %s (ack_deadline) WHERE state = ''fired''', queue_name || '_fired', t);
    -- acked and failed events of a partition, oldest first (retention slices)
    PERFORM qm.create_retention_indexes(queue_name);
    -- producer deduplication, per tenant
    EXECUTE format('CREATE UNIQUE INDEX %I ON %s (tenant, dedup_key) WHERE dedup_key IS NOT NULL', queue_name || '_dedup', t);
    PERFORM qm.apply_queue(q.id);
    SELECT * INTO q FROM qm.queues WHERE id = q.id;
    RETURN q;
END
$$;

-- existing queues: the global (acked_at) index gives way to the per-partition ones
DO $$
DECLARE
    queue_name text;
BEGIN
    FOR queue_name IN SELECT name FROM qm.queues ORDER BY id LOOP
        EXECUTE format('DROP INDEX IF EXISTS public.%I', queue_name || '_acked');
        PERFORM qm.create_retention_indexes(queue_name);
    END LOOP;
END
$$;

-- ---------------------------------------------------------------- the done counters' lock

CREATE FUNCTION qm.load_lock_key() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN 29038;

-- Count events that left the queue (acked, dead-lettered, settled by SQL) in their partitions'
-- done sequences; `parts` holds one entry per event. The queue's load lock, held to the end of the
-- caller's transaction, orders this read-then-set against a reconciliation slice of any manager
-- process: the slice counts the live events and sets the counter either wholly before this
-- statement's events left (it saw them live, and this adds them) or wholly after its commit (it
-- did not see them, and sets the counter from the enqueue count). One lock per statement: a
-- slice holds it for one partition's count, a few milliseconds.
CREATE OR REPLACE FUNCTION qm.add_done(queue_id integer, parts smallint[]) RETURNS void
LANGUAGE sql AS $$
    SELECT pg_advisory_xact_lock(qm.load_lock_key(), add_done.queue_id) WHERE cardinality(parts) > 0;
    SELECT setval(q.done_seqs[c.p + 1], coalesce(pg_sequence_last_value(q.done_seqs[c.p + 1]), 0) + c.n)
      FROM qm.queues q,
           (SELECT u.p, count(*) AS n FROM unnest(parts) AS u(p) GROUP BY u.p) c
     WHERE q.id = add_done.queue_id AND c.p >= 0 AND c.p < cardinality(q.done_seqs);
$$;

-- One partition's reconciliation: afterwards load(part) = its live events (to_be_fired + fired).
-- Returns {load before, live events}. Tries the queue's load lock and raises lock_not_available
-- (55P03) at once when an ack statement holds it: the slice is aborted, not retried, and a later
-- slice does the partition. The count reads one partition of the <queue>_due index and the
-- <queue>_fired index (no acked row); the enqueue counter is read after it, so an insert whose
-- counter moved before the count is either counted or still uncommitted (and counted once it
-- commits), never lost.
CREATE FUNCTION qm.reconcile_partition(queue_name text, part integer) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
    live bigint;
    enq bigint;
    done bigint;
BEGIN
    SELECT * INTO q FROM qm.queues WHERE name = queue_name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" does not exist on this shard', queue_name USING ERRCODE = '42P01';
    END IF;
    IF part IS NULL OR part < 0 OR part >= q.partitions_physical THEN
        RAISE EXCEPTION 'queue "%" has no partition % (it has %)', queue_name, part, q.partitions_physical
            USING ERRCODE = '22023';
    END IF;
    IF NOT pg_try_advisory_xact_lock(qm.load_lock_key(), q.id) THEN
        RAISE EXCEPTION 'the load counters of queue "%" are being written', queue_name
            USING ERRCODE = '55P03', HINT = 'a maintenance slice gives up here; a later one does the partition';
    END IF;
    EXECUTE format('SELECT (SELECT count(*) FROM public.%1$I WHERE partition = $1 AND state = ''to_be_fired'') '
                   '     + (SELECT count(*) FROM public.%1$I WHERE partition = $1 AND state = ''fired'')', q.name)
        INTO live USING part;
    enq := coalesce(pg_sequence_last_value(q.enq_seqs[part + 1]), 0);
    done := coalesce(pg_sequence_last_value(q.done_seqs[part + 1]), 0);
    PERFORM setval(q.done_seqs[part + 1], enq - live);
    RETURN ARRAY[enq - done, live];
END
$$;

-- The whole queue's reconciliation (tests, benchmarks, an operator): revision 0004's function,
-- under the queue's load lock (waited for, not tried).
CREATE OR REPLACE FUNCTION qm.reconcile_load(queue_name text) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
    live bigint[];
BEGIN
    SELECT * INTO q FROM qm.queues WHERE name = queue_name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" does not exist on this shard', queue_name USING ERRCODE = '42P01';
    END IF;
    PERFORM pg_advisory_xact_lock(qm.load_lock_key(), q.id);
    -- one count per state, so that each can use its partial index (<queue>_due, <queue>_fired)
    -- and no scan visits the acked rows
    EXECUTE format(
        'SELECT array_agg(coalesce(c.n, 0) ORDER BY p) FROM generate_series(0, $1 - 1) p '
        'LEFT JOIN (SELECT u.partition, sum(u.n) AS n FROM ('
        '    SELECT partition, count(*) AS n FROM public.%1$I WHERE state = ''to_be_fired'' GROUP BY partition '
        '    UNION ALL '
        '    SELECT partition, count(*) AS n FROM public.%1$I WHERE state = ''fired'' GROUP BY partition) u '
        'GROUP BY u.partition) c ON c.partition = p', q.name)
        INTO live USING q.partitions_physical;
    PERFORM setval(s.dseq, coalesce(pg_sequence_last_value(s.seq), 0) - live[s.ord])
       FROM unnest(q.enq_seqs, q.done_seqs) WITH ORDINALITY AS s(seq, dseq, ord);
    RETURN live;
END
$$;

-- ---------------------------------------------------------------- the slices' counters

CREATE FUNCTION qm.maintenance_jobs() RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN ARRAY['collector', 'retention', 'reconciliation'];

CREATE FUNCTION qm.maintenance_lock_key() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN 29039;

DO $$
DECLARE
    job text;
    what text;
BEGIN
    FOREACH job IN ARRAY qm.maintenance_jobs() LOOP
        FOREACH what IN ARRAY ARRAY['recruited', 'finished', 'aborted', 'events'] LOOP
            EXECUTE format('CREATE SEQUENCE qm.%I', 'maint_' || job || '_' || what);
        END LOOP;
    END LOOP;
END
$$;

-- Count a slice of a maintenance job: `what` is recruited, finished or aborted (n slices, nextval:
-- no lock), or events (what the slices handled: deleted, corrected, moved; a read-then-set under
-- an advisory lock held to the end of the caller's transaction, so that concurrent slices of
-- several managers add up). Counts are not transactional: an aborted slice stays recruited.
CREATE FUNCTION qm.count_maintenance(job text, what text, n bigint DEFAULT 1) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    seq regclass;
BEGIN
    IF job IS NULL OR NOT job = ANY (qm.maintenance_jobs())
       OR what IS NULL OR NOT what = ANY (ARRAY['recruited', 'finished', 'aborted', 'events']) THEN
        RAISE EXCEPTION 'no maintenance counter %.%: jobs are %, counters recruited, finished, aborted, events',
            quote_nullable(job), quote_nullable(what), array_to_string(qm.maintenance_jobs(), ', ')
            USING ERRCODE = '22023';
    END IF;
    IF n IS NULL OR n <= 0 THEN
        RETURN;
    END IF;
    seq := format('qm.%I', 'maint_' || job || '_' || what)::regclass;
    IF what = 'events' THEN
        PERFORM pg_advisory_xact_lock(qm.maintenance_lock_key(), array_position(qm.maintenance_jobs(), job));
        PERFORM setval(seq, coalesce(pg_sequence_last_value(seq), 0) + n);
    ELSE
        PERFORM nextval(seq) FROM generate_series(1, n);
    END IF;
END
$$;

-- Every job's counts on this shard, since the revision was applied.
CREATE FUNCTION qm.maintenance_counts()
RETURNS TABLE (job text, recruited bigint, finished bigint, aborted bigint, events bigint)
LANGUAGE sql AS $$
    SELECT j,
           coalesce(pg_sequence_last_value(format('qm.%I', 'maint_' || j || '_recruited')::regclass), 0),
           coalesce(pg_sequence_last_value(format('qm.%I', 'maint_' || j || '_finished')::regclass), 0),
           coalesce(pg_sequence_last_value(format('qm.%I', 'maint_' || j || '_aborted')::regclass), 0),
           coalesce(pg_sequence_last_value(format('qm.%I', 'maint_' || j || '_events')::regclass), 0)
      FROM unnest(qm.maintenance_jobs()) WITH ORDINALITY AS u(j, o)
     ORDER BY o;
$$;
