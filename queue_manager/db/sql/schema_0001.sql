-- Foundation schema of a shard (alembic revision 0001). Applied identically to every shard.
--
-- Objects:
--   qm.shard            this shard's identity and keyspace range (one row)
--   qm.shard_map        every shard of the topology (to name the right shard in errors)
--   qm.queues           the queue registry, one row per queue, with its settings
--   qm.queue_load       per-queue "done" counters; load(p) = enqueued(p) - done(p)
--   qm.q<id>_p<n>_enq   one sequence per (queue, partition): events enqueued, bumped without row locks
--   public.<queue>      the queue table itself: INSERT INTO <queue> (tenant, payload) VALUES (...)
--
-- Writes go through two paths that enforce the same rules:
--   * a plain INSERT leaves `partition` NULL: the BEFORE ROW trigger qm.route_event() validates
--     the row with precise error messages and picks the least-loaded partition of the tenant's
--     shuffle set;
--   * bulk loaders (COPY from Python, JDBC from Spark) compute the partition themselves; the
--     trigger is skipped (its WHEN clause is evaluated in C) and CHECK constraints, also in C,
--     refuse any row on the wrong shard, in a foreign partition, oversized, or with a bad fire_at.
-- The routing formulas are specified in queue_manager/domain/routing.py.

CREATE SCHEMA IF NOT EXISTS qm;

CREATE TYPE qm.event_state AS ENUM ('to_be_fired', 'fired', 'acked', 'failed');

CREATE TABLE qm.shard (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    name        text NOT NULL,
    range_start text NOT NULL,   -- 16 hex digits, '' = start of keyspace
    range_end   text NOT NULL,   -- 16 hex digits, '' = end of keyspace
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE qm.shard_map (
    name        text PRIMARY KEY,
    range_start text NOT NULL,
    range_end   text NOT NULL
);

CREATE TABLE qm.queues (
    id                  integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name                text NOT NULL UNIQUE CHECK (name ~ '^[a-z][a-z0-9_]{0,39}$' AND name NOT LIKE 'qm\_%'),
    -- N: partitions new events are written to
    partitions          integer NOT NULL DEFAULT 16 CHECK (partitions BETWEEN 1 AND 1024),
    -- partitions that may still hold events: > partitions while a shrink drains
    partitions_physical integer NOT NULL DEFAULT 16 CHECK (partitions_physical >= partitions),
    -- k: shuffle-shard size
    shuffle             integer NOT NULL DEFAULT 4 CHECK (shuffle BETWEEN 1 AND 16 AND shuffle <= partitions),
    window_seconds      double precision NOT NULL DEFAULT 30 CHECK (window_seconds > 0 AND window_seconds <= 3600),
    cache_size          integer NOT NULL DEFAULT 10000 CHECK (cache_size BETWEEN 1 AND 10000000),
    ack_timeout_seconds double precision NOT NULL DEFAULT 30 CHECK (ack_timeout_seconds > 0 AND ack_timeout_seconds <= 86400),
    backoff_min_seconds double precision NOT NULL DEFAULT 1 CHECK (backoff_min_seconds >= 0),
    backoff_max_seconds double precision NOT NULL DEFAULT 300,
    max_attempts        integer NOT NULL DEFAULT 20 CHECK (max_attempts BETWEEN 1 AND 1000),
    max_qps             double precision CHECK (max_qps IS NULL OR max_qps > 0),
    max_concurrency     integer CHECK (max_concurrency IS NULL OR max_concurrency > 0),
    retention_seconds   double precision NOT NULL DEFAULT 604800 CHECK (retention_seconds >= 0),
    payload_limit_bytes integer NOT NULL DEFAULT 65536 CHECK (payload_limit_bytes BETWEEN 16 AND 104857600),
    max_delay_seconds   double precision NOT NULL DEFAULT 315576000 CHECK (max_delay_seconds > 0),
    paused              boolean NOT NULL DEFAULT false,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    -- enqueue counters, element p+1 for partition p (length partitions_physical)
    enq_seqs            regclass[] NOT NULL DEFAULT '{}',
    CHECK (backoff_max_seconds >= backoff_min_seconds)
);

COMMENT ON COLUMN qm.queues.max_delay_seconds IS 'latest accepted fire_at, relative to now() at insert';

CREATE TABLE qm.queue_load (
    queue_id integer PRIMARY KEY REFERENCES qm.queues (id) ON DELETE CASCADE,
    -- done[p+1]: events of partition p that left the queue (acked, failed, deleted); written by the manager
    done     bigint[] NOT NULL DEFAULT '{}'
);

-- The settings a client may pass to create_queue / alter_queue, with their SQL types.
CREATE FUNCTION qm.settable_columns() RETURNS text[]
LANGUAGE sql IMMUTABLE
RETURN ARRAY['partitions', 'shuffle', 'window_seconds', 'cache_size', 'ack_timeout_seconds',
             'backoff_min_seconds', 'backoff_max_seconds', 'max_attempts', 'max_qps', 'max_concurrency',
             'retention_seconds', 'payload_limit_bytes', 'max_delay_seconds', 'paused'];

-- The 16 hex digits that ranges compare against.
CREATE FUNCTION qm.keyspace_hex(tenant text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN substr(md5(tenant), 1, 16);

-- The tenant's shuffle set (ascending), as specified in routing.py.
CREATE FUNCTION qm.shuffle_set(tenant text, n integer, k integer) RETURNS smallint[]
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
    h text := md5(tenant);
    w integer := least(16 / k, 7);
    lo integer;
    hi integer;
    picks smallint[] := '{}';
BEGIN
    IF n < 1 OR n > 1024 OR k < 1 OR k > 16 OR k > n THEN
        RAISE EXCEPTION 'qm.shuffle_set: need 1 <= k <= min(n, 16) and 1 <= n <= 1024, got n=%, k=%', n, k
            USING ERRCODE = '22023';
    END IF;
    FOR j IN 0 .. k - 1 LOOP
        lo := (j * n) / k;
        hi := ((j + 1) * n) / k;
        picks := picks || (lo + ('x' || lpad(substr(h, 17 + j * w, w), 8, '0'))::bit(32)::integer % (hi - lo))::smallint;
    END LOOP;
    RETURN picks;
END
$$;

-- The shard that owns a tenant, from the topology stored on this shard (NULL if unknown).
CREATE FUNCTION qm.shard_for(tenant text) RETURNS text
LANGUAGE sql STABLE STRICT
BEGIN ATOMIC
    SELECT m.name FROM qm.shard_map m
     WHERE (m.range_start = '' OR qm.keyspace_hex(tenant) COLLATE "C" >= m.range_start)
       AND (m.range_end = '' OR qm.keyspace_hex(tenant) COLLATE "C" < m.range_end)
     LIMIT 1;
END;

-- Approximate load of each partition (index p+1 for partition p): enqueued minus done.
CREATE FUNCTION qm.partition_loads(queue_name text) RETURNS bigint[]
LANGUAGE sql STABLE STRICT
BEGIN ATOMIC
    SELECT array_agg(coalesce(pg_sequence_last_value(s.seq), 0) - coalesce(l.done[s.ord], 0) ORDER BY s.ord)
      FROM qm.queues q
      JOIN qm.queue_load l ON l.queue_id = q.id
     CROSS JOIN LATERAL unnest(q.enq_seqs) WITH ORDINALITY AS s(seq, ord)
     WHERE q.name = queue_name;
END;

-- Bump the enqueue counters after a bulk load that chose its partitions itself.
CREATE FUNCTION qm.add_load(queue_name text, partitions integer[], counts integer[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    seqs regclass[];
BEGIN
    SELECT q.enq_seqs INTO seqs FROM qm.queues q WHERE q.name = queue_name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" does not exist on this shard', queue_name USING ERRCODE = '42P01';
    END IF;
    PERFORM nextval(seqs[p.part + 1])
       FROM unnest(partitions, counts) AS p(part, cnt), generate_series(1, p.cnt)
      WHERE p.part >= 0 AND p.part < cardinality(seqs);
END
$$;

-- BEFORE INSERT ROW trigger of every queue table. Runs only when the partition is left to the
-- database or the row claims a state other than a fresh event. The queue's settings and the
-- shard's range arrive as trigger arguments (qm.apply_queue regenerates the trigger whenever
-- they change), so a routed insert reads no catalog row but the load counters:
--   TG_ARGV: 0 queue id, 1 N, 2 k, 3 payload limit, 4 max delay (s), 5 shard name ('' = unset),
--            6 range start, 7 range end, 8.. enqueue-counter sequence oids, one per partition
CREATE FUNCTION qm.route_event() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    n integer := TG_ARGV[1]::integer;
    k integer := TG_ARGV[2]::integer;
    h text;
    kid text;
    right_shard text;
    done bigint[];
    w integer;
    pick integer;
    load bigint;
    best integer := -1;
    best_load bigint;
BEGIN
    IF NEW.state IS DISTINCT FROM 'to_be_fired' OR NEW.attempts IS DISTINCT FROM 0
       OR NEW.fired_at IS NOT NULL OR NEW.acked_at IS NOT NULL OR NEW.ack_deadline IS NOT NULL THEN
        RAISE EXCEPTION 'queue "%": new events must start as to_be_fired with attempts 0 (leave state, attempts, fired_at, acked_at and ack_deadline to their defaults)', TG_TABLE_NAME
            USING ERRCODE = '23514', HINT = 'INSERT INTO <queue> (tenant, payload[, fire_at, dedup_key]) VALUES (...)';
    END IF;
    IF NEW.tenant IS NULL OR NEW.tenant = '' THEN
        RAISE EXCEPTION 'queue "%": tenant must be a non-empty string, got %', TG_TABLE_NAME,
            CASE WHEN NEW.tenant IS NULL THEN 'NULL' ELSE 'an empty string' END
            USING ERRCODE = '23514';
    END IF;
    IF NEW.fire_at IS NULL THEN
        RAISE EXCEPTION 'queue "%": fire_at must not be NULL (omit the column to fire as soon as possible)', TG_TABLE_NAME
            USING ERRCODE = '23514';
    END IF;
    IF NEW.payload IS NULL THEN
        RAISE EXCEPTION 'queue "%": payload must not be NULL (use ''{}'' or ''null''::jsonb for an empty payload)', TG_TABLE_NAME
            USING ERRCODE = '23514';
    END IF;
    IF TG_ARGV[5] = '' THEN
        RAISE EXCEPTION 'this database has no shard identity yet' USING ERRCODE = '55000',
            HINT = 'run: qm migrate --topology <file>';
    END IF;
    IF NEW.fire_at < timestamptz '2000-01-01' OR NEW.fire_at > now() + make_interval(secs => TG_ARGV[4]::double precision) THEN
        RAISE EXCEPTION 'queue "%": fire_at % is out of range: it must be finite, after 2000-01-01 and at most % seconds from now',
            TG_TABLE_NAME, NEW.fire_at, TG_ARGV[4] USING ERRCODE = '22008';
    END IF;

    h := md5(NEW.tenant);
    kid := substr(h, 1, 16);
    IF (TG_ARGV[6] <> '' AND kid COLLATE "C" < TG_ARGV[6]) OR (TG_ARGV[7] <> '' AND kid COLLATE "C" >= TG_ARGV[7]) THEN
        right_shard := qm.shard_for(NEW.tenant);
        RAISE EXCEPTION 'tenant % belongs to shard "%", not to this shard "%" (keyspace id %)',
            quote_literal(NEW.tenant), coalesce(right_shard, '<unknown: topology not stored>'), TG_ARGV[5], kid
            USING ERRCODE = '23514', HINT = 'route by keyspace id (queue_manager.Router does this)',
                  DETAIL = 'right_shard=' || coalesce(right_shard, '');
    END IF;

    IF pg_column_size(NEW.payload) > TG_ARGV[3]::integer THEN
        RAISE EXCEPTION 'queue "%": payload of % bytes exceeds the queue''s limit of % bytes',
            TG_TABLE_NAME, pg_column_size(NEW.payload), TG_ARGV[3] USING ERRCODE = '54000';
    END IF;

    IF NEW.dedup_key IS NOT NULL THEN
        -- serialise producers of the same key; READ COMMITTED then sees a committed twin
        PERFORM pg_advisory_xact_lock(TG_ARGV[0]::integer, hashtext(NEW.tenant || chr(31) || NEW.dedup_key));
        EXECUTE format('SELECT 1 FROM %I.%I WHERE tenant = $1 AND dedup_key = $2', TG_TABLE_SCHEMA, TG_TABLE_NAME)
            USING NEW.tenant, NEW.dedup_key;
        GET DIAGNOSTICS pick = ROW_COUNT;
        IF pick > 0 THEN
            RETURN NULL;  -- an event with this dedup key exists: the insert does nothing
        END IF;
    END IF;

    IF NEW.partition IS NULL THEN
        SELECT l.done INTO done FROM qm.queue_load l WHERE l.queue_id = TG_ARGV[0]::integer;
        -- the pick formula of qm.shuffle_set, inlined: a call would cost a second md5 and a
        -- function call per insert (tests compare the partitions chosen with the Python spec)
        w := least(16 / k, 7);
        FOR j IN 0 .. k - 1 LOOP
            pick := (j * n) / k + ('x' || lpad(substr(h, 17 + j * w, w), 8, '0'))::bit(32)::integer % (((j + 1) * n) / k - (j * n) / k);
            load := coalesce(pg_sequence_last_value(TG_ARGV[8 + pick]::oid::regclass), 0) - coalesce(done[pick + 1], 0);
            IF best < 0 OR load < best_load THEN
                best := pick;
                best_load := load;
            END IF;
        END LOOP;
        NEW.partition := best;
        PERFORM nextval(TG_ARGV[8 + best]::oid::regclass);
    END IF;
    RETURN NEW;
END
$$;

-- AFTER INSERT STATEMENT trigger: wake the manager only if it is waiting. A waiting manager holds
-- the exclusive advisory lock (qm_wake_class, queue id); producers try the shared form. If the try
-- fails, the manager waits and must be told; if it succeeds, the manager will take the exclusive
-- lock only after this transaction ends, and its next scan sees this row. So there is no lost
-- wake-up, and producers pay the NOTIFY commit lock only when a manager is idle.
CREATE FUNCTION qm.wake_manager() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock_shared(29037, TG_ARGV[0]::integer) THEN
        PERFORM pg_notify('qm_wake', TG_TABLE_NAME);
    END IF;
    RETURN NULL;
END
$$;

-- The CHECK constraints of a queue, derived from its settings and the shard's range. They
-- apply to rows with attempts = 0 (fresh events, whatever path wrote them); the manager's own
-- updates always carry attempts >= 1, so a later change of N, of the payload limit or of the
-- shard range never blocks draining the rows written before it.
CREATE FUNCTION qm.apply_queue(queue_id integer) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
    s qm.shard;
    t text;
    w integer;
    lo_arr integer[];
    off_arr integer[];
    size_arr integer[];
    range_expr text := 'true';
    seqs regclass[] := '{}';
    seq_name text;
BEGIN
    SELECT * INTO STRICT q FROM qm.queues WHERE id = queue_id;
    SELECT * INTO s FROM qm.shard;
    t := format('public.%I', q.name);
    w := least(16 / q.shuffle, 7);

    FOR p IN 0 .. q.partitions_physical - 1 LOOP
        seq_name := format('q%s_p%s_enq', q.id, p);
        EXECUTE format('CREATE SEQUENCE IF NOT EXISTS qm.%I', seq_name);
        seqs := seqs || format('qm.%I', seq_name)::regclass;
    END LOOP;
    FOR p IN q.partitions_physical .. 1023 LOOP
        seq_name := format('q%s_p%s_enq', q.id, p);
        EXIT WHEN to_regclass(format('qm.%I', seq_name)) IS NULL;
        EXECUTE format('DROP SEQUENCE qm.%I', seq_name);
    END LOOP;
    UPDATE qm.queues SET enq_seqs = seqs WHERE id = queue_id;
    INSERT INTO qm.queue_load (queue_id) VALUES (queue_id) ON CONFLICT DO NOTHING;

    IF s.name IS NOT NULL THEN
        IF s.range_start <> '' THEN
            range_expr := format('substr(md5(tenant), 1, 16) COLLATE "C" >= %L', s.range_start);
        END IF;
        IF s.range_end <> '' THEN
            range_expr := range_expr || format(' AND substr(md5(tenant), 1, 16) COLLATE "C" < %L', s.range_end);
        END IF;
    END IF;

    EXECUTE format('ALTER TABLE %s DROP CONSTRAINT IF EXISTS %I, DROP CONSTRAINT IF EXISTS %I, DROP CONSTRAINT IF EXISTS %I',
                   t, q.name || '_tenant_on_this_shard', q.name || '_partition_in_shuffle_set',
                   q.name || '_payload_within_limit');
    EXECUTE format('ALTER TABLE %s ADD CONSTRAINT %I CHECK (attempts > 0 OR (%s)) NOT VALID',
                   t, q.name || '_tenant_on_this_shard', range_expr);
    -- per partition p (index p+1): its group's first partition, the 1-based hex offset of the
    -- group's draw in md5(tenant), and the group's size; constants keep the check small
    SELECT array_agg((g.j * q.partitions) / q.shuffle ORDER BY p),
           array_agg(17 + g.j * w ORDER BY p),
           array_agg(((g.j + 1) * q.partitions) / q.shuffle - (g.j * q.partitions) / q.shuffle ORDER BY p)
      INTO lo_arr, off_arr, size_arr
      FROM generate_series(0, q.partitions - 1) p
     CROSS JOIN LATERAL (SELECT ((p + 1) * q.shuffle - 1) / q.partitions AS j) g;
    EXECUTE format(
        'ALTER TABLE %s ADD CONSTRAINT %I CHECK (attempts > 0 OR (partition >= 0 AND partition < %s AND '
        'partition - (%L::integer[])[partition + 1] = '
        '(''x'' || substr(md5(tenant), (%L::integer[])[partition + 1], %s))::bit(%s)::integer'
        ' %% (%L::integer[])[partition + 1])) NOT VALID',
        t, q.name || '_partition_in_shuffle_set', q.partitions, lo_arr, off_arr, w, w * 4, size_arr);
    EXECUTE format('ALTER TABLE %s ADD CONSTRAINT %I CHECK (attempts > 0 OR pg_column_size(payload) <= %s) NOT VALID',
                   t, q.name || '_payload_within_limit', q.payload_limit_bytes);

    EXECUTE format('DROP TRIGGER IF EXISTS qm_route ON %s', t);
    EXECUTE format(
        'CREATE TRIGGER qm_route BEFORE INSERT ON %s FOR EACH ROW '
        'WHEN (NEW.partition IS NULL OR NEW.attempts <> 0 OR NEW.state <> ''to_be_fired'' '
        'OR NEW.fired_at IS NOT NULL OR NEW.acked_at IS NOT NULL OR NEW.ack_deadline IS NOT NULL) '
        'EXECUTE FUNCTION qm.route_event(%s)', t,
        (SELECT string_agg(quote_literal(a.arg), ', ' ORDER BY a.ord) FROM unnest(
            ARRAY[q.id::text, q.partitions::text, q.shuffle::text, q.payload_limit_bytes::text,
                  q.max_delay_seconds::text, coalesce(s.name, ''), coalesce(s.range_start, ''), coalesce(s.range_end, '')]
            || (SELECT coalesce(array_agg(x::oid::text ORDER BY o), '{}') FROM unnest(seqs) WITH ORDINALITY AS u(x, o))
        ) WITH ORDINALITY AS a(arg, ord)));
END
$$;

-- Validate a settings object against the registry's columns; returns it unchanged.
CREATE FUNCTION qm.check_settings(settings jsonb) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    key text;
BEGIN
    IF settings IS NULL OR jsonb_typeof(settings) <> 'object' THEN
        RAISE EXCEPTION 'queue settings must be a JSON object, got %', coalesce(jsonb_typeof(settings), 'NULL')
            USING ERRCODE = '22023';
    END IF;
    FOR key IN SELECT jsonb_object_keys(settings) LOOP
        IF NOT key = ANY (qm.settable_columns()) THEN
            RAISE EXCEPTION 'unknown queue setting "%"; known settings: %', key, array_to_string(qm.settable_columns(), ', ')
                USING ERRCODE = '22023';
        END IF;
    END LOOP;
    RETURN settings;
END
$$;

-- Write the given settings over a registry row (absent keys keep their value; for a new row,
-- the column defaults). Range checks are the table's CHECK constraints.
CREATE FUNCTION qm.write_settings(queue_id integer, settings jsonb) RETURNS void
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
        payload_limit_bytes = coalesce((settings->>'payload_limit_bytes')::integer, payload_limit_bytes),
        max_delay_seconds   = coalesce((settings->>'max_delay_seconds')::double precision, max_delay_seconds),
        paused              = coalesce((settings->>'paused')::boolean, paused),
        updated_at          = now()
    WHERE id = queue_id;
END
$$;

-- Create a queue on this shard: registry row, table, indexes, triggers, constraints, counters.
CREATE FUNCTION qm.create_queue(queue_name text, settings jsonb DEFAULT '{}', if_not_exists boolean DEFAULT false)
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
            last_error   text,
            CONSTRAINT %2$I CHECK (tenant <> ''),
            CONSTRAINT %3$I CHECK (fire_at >= '2000-01-01' AND fire_at < '2200-01-01'),
            CONSTRAINT %4$I CHECK (attempts >= 0)
        ) WITH (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02)$ddl$,
        t, queue_name || '_tenant_not_empty', queue_name || '_fire_at_in_range', queue_name || '_attempts_not_negative');
    EXECUTE format('COMMENT ON TABLE %s IS %L', t, 'qm queue; INSERT INTO ' || queue_name || ' (tenant, payload[, fire_at, dedup_key])');
    -- due events of a partition in fire order (window scans, per-partition round robin)
    EXECUTE format('CREATE INDEX %I ON %s (partition, fire_at) WHERE state = ''to_be_fired''', queue_name || '_due', t);
    -- fired events by ack deadline (re-fire, old-event collector)
    EXECUTE format('CREATE INDEX %I ON %s (ack_deadline) WHERE state = ''fired''', queue_name || '_fired', t);
    -- producer deduplication, per tenant
    EXECUTE format('CREATE UNIQUE INDEX %I ON %s (tenant, dedup_key) WHERE dedup_key IS NOT NULL', queue_name || '_dedup', t);
    EXECUTE format('CREATE TRIGGER qm_wake AFTER INSERT ON %s FOR EACH STATEMENT EXECUTE FUNCTION qm.wake_manager(%L)', t, q.id);
    PERFORM qm.apply_queue(q.id);
    SELECT * INTO q FROM qm.queues WHERE id = q.id;
    RETURN q;
END
$$;

-- Change a queue's settings. Growing N takes effect at once. Shrinking N stops new writes to the
-- dropped partitions at once and completes (partitions_physical = N) only when they are empty:
-- see qm.finish_resize.
CREATE FUNCTION qm.alter_queue(queue_name text, settings jsonb) RETURNS qm.queues
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
BEGIN
    SELECT * INTO q FROM qm.queues WHERE name = queue_name FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" does not exist on this shard', queue_name USING ERRCODE = '42P01';
    END IF;
    PERFORM qm.write_settings(q.id, settings);
    PERFORM qm.apply_queue(q.id);
    PERFORM qm.finish_resize(queue_name);
    SELECT * INTO q FROM qm.queues WHERE id = q.id;
    RETURN q;
END
$$;

-- Complete a pending shrink when the dropped partitions hold no live event. Returns the number
-- of live events still in partitions >= N (0 when nothing is pending or the shrink completed).
CREATE FUNCTION qm.finish_resize(queue_name text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
    remaining bigint;
BEGIN
    SELECT * INTO q FROM qm.queues WHERE name = queue_name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" does not exist on this shard', queue_name USING ERRCODE = '42P01';
    END IF;
    IF q.partitions_physical = q.partitions THEN
        RETURN 0;
    END IF;
    EXECUTE format('SELECT count(*) FROM public.%I WHERE partition >= $1 AND state IN (''to_be_fired'', ''fired'')', q.name)
        INTO remaining USING q.partitions;
    IF remaining = 0 THEN
        UPDATE qm.queues SET partitions_physical = partitions, updated_at = now() WHERE id = q.id;
        PERFORM qm.apply_queue(q.id);
    END IF;
    RETURN remaining;
END
$$;

-- Record this shard's identity and the whole topology, then re-derive every queue's constraints.
CREATE FUNCTION qm.set_topology(this_shard text, shards jsonb) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    me jsonb;
    qid integer;
BEGIN
    SELECT e INTO me FROM jsonb_array_elements(shards) e WHERE e->>'name' = this_shard;
    IF me IS NULL THEN
        RAISE EXCEPTION 'shard "%" is not in the topology given', this_shard USING ERRCODE = '22023';
    END IF;
    DELETE FROM qm.shard_map;
    INSERT INTO qm.shard_map (name, range_start, range_end)
    SELECT e->>'name', e->>'range_start', e->>'range_end' FROM jsonb_array_elements(shards) e;
    INSERT INTO qm.shard (name, range_start, range_end) VALUES (this_shard, me->>'range_start', me->>'range_end')
    ON CONFLICT (singleton) DO UPDATE
       SET name = excluded.name, range_start = excluded.range_start, range_end = excluded.range_end, updated_at = now();
    FOR qid IN SELECT id FROM qm.queues LOOP
        PERFORM qm.apply_queue(qid);
    END LOOP;
END
$$;

-- Re-anchor the load counters on the truth: afterwards load(p) = live events (to_be_fired + fired)
-- in partition p. The counters drift by design (a rolled-back insert has bumped its sequence);
-- the manager calls this periodically, and it is safe to call any time.
CREATE FUNCTION qm.reconcile_load(queue_name text) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
    live bigint[];
BEGIN
    SELECT * INTO q FROM qm.queues WHERE name = queue_name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" does not exist on this shard', queue_name USING ERRCODE = '42P01';
    END IF;
    EXECUTE format(
        'SELECT array_agg(coalesce(c.n, 0) ORDER BY p) FROM generate_series(0, $1 - 1) p '
        'LEFT JOIN (SELECT partition, count(*) AS n FROM public.%I WHERE state IN (''to_be_fired'', ''fired'') '
        'GROUP BY partition) c ON c.partition = p', q.name)
        INTO live USING q.partitions_physical;
    UPDATE qm.queue_load l
       SET done = (SELECT array_agg(coalesce(pg_sequence_last_value(s.seq), 0) - live[s.ord] ORDER BY s.ord)
                     FROM unnest(q.enq_seqs) WITH ORDINALITY AS s(seq, ord))
     WHERE l.queue_id = q.id;
    RETURN live;
END
$$;
