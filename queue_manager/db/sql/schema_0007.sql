-- Revision 0007: Spark loads stage each run in a table of its own, and a two-phase publish can wake
-- the manager.
--
--   qm.spark_stage_<n>   UNLOGGED, one per (run, queue) on each shard, created by qm.stage_run and
--                        dropped by the publish (or by qm.cleanup_spark_runs): no index to keep up
--                        while Spark's tasks write, no DELETE, no dead rows, no vacuum. It holds every
--                        row of the run, the good and the rejected (with their reason), so the counts
--                        come from the database and the rejects can be read back. Replaces revision
--                        0006's shared qm.spark_staging, whose publish deleted the run's rows from a
--                        table autovacuum never visited (it grew by every run's size).
--   qm.spark_runs        the ledger gains the stage table, the counts (good, rejected, duplicates
--                        written by retried tasks) and the earliest fire_at of the published rows;
--                        states: staging -> staged -> published, or abandoned. A two-phase publish
--                        writes 'published' inside its prepared transaction: it shows at COMMIT
--                        PREPARED, and a rollback leaves the run staged.
--   qm.spark_decisions   gains the outcome: recovery records 'abort' for an undecided run before it
--                        rolls anything back, and a job records 'commit' only if no abort is there,
--                        so the two can never both act on one run.
--   qm.stage_run()       begin (or resume) a run's staging on this shard
--   qm.staged_run()      count what the tasks wrote and mark the run staged
--   qm.publish_run()     one INSERT ... SELECT into the queue table, the load counters, the ledger,
--                        the stage table dropped, all in the caller's transaction
--   qm.abandon_run()     drop a run's staging (its rows were rejected, or the run is given up)
--   qm.cleanup_spark_runs()  abandon the staging of runs left unfinished for longer than a TTL
--   qm.apply_queue()     the same code as revision 0005's, except that the verify trigger leaves its
--                        wake-up to the caller when qm.defer_wake is on: PREPARE TRANSACTION refuses a
--                        transaction that has sent a NOTIFY, so a two-phase publish sends it itself
--                        after COMMIT PREPARED. Applied to every existing queue at the end.

DROP FUNCTION qm.publish_run(text, text, text);
DROP TABLE qm.spark_staging;

CREATE SEQUENCE qm.spark_stage_seq;

ALTER TABLE qm.spark_runs
    DROP CONSTRAINT spark_runs_state_check,
    ADD CONSTRAINT spark_runs_state_check CHECK (state IN ('staging', 'staged', 'published', 'abandoned')),
    -- the run's stage table on this shard (qm.spark_stage_<n>), NULL once dropped
    ADD COLUMN stage_table text,
    -- distinct rows staged without a reason, and with one (rejected)
    ADD COLUMN good_rows bigint,
    ADD COLUMN rejected_rows bigint,
    -- rows written twice by retried or speculative tasks (kept once)
    ADD COLUMN duplicate_rows bigint,
    -- good rows skipped at publish because their (tenant, dedup_key) already existed
    ADD COLUMN dedup_skipped bigint,
    -- what the manager is told after a two-phase commit: the earliest fire_at, or the publish's start
    ADD COLUMN wake_at timestamptz;
COMMENT ON TABLE qm.spark_runs IS 'Spark load ledger: one row per (run, queue) on each shard; see spark_jobs/enqueue.py';

ALTER TABLE qm.spark_decisions
    ADD COLUMN outcome text NOT NULL DEFAULT 'commit' CHECK (outcome IN ('commit', 'abort'));

-- Begin, or resume, the staging of (run, queue) on this shard. Returns the ledger row: state
-- 'published' (nothing to do), 'staged' (the rows are all there: publish them) or 'staging' with
-- a new, empty stage table for Spark's tasks to write. An earlier attempt's partial staging is
-- dropped first: its tasks' rows may be incomplete.
CREATE FUNCTION qm.stage_run(run text, queue_name text) RETURNS qm.spark_runs
LANGUAGE plpgsql AS $$
DECLARE
    r qm.spark_runs;
    t text;
BEGIN
    IF NOT EXISTS (SELECT FROM qm.queues WHERE name = queue_name) THEN
        RAISE EXCEPTION 'queue "%" does not exist on this shard', queue_name USING ERRCODE = '42P01';
    END IF;
    INSERT INTO qm.spark_runs (run_id, queue, state) VALUES (run, queue_name, 'staging') ON CONFLICT DO NOTHING;
    SELECT * INTO STRICT r FROM qm.spark_runs WHERE run_id = run AND queue = queue_name FOR UPDATE;
    IF r.state IN ('published', 'staged') THEN
        RETURN r;
    END IF;
    IF r.stage_table IS NOT NULL THEN
        EXECUTE format('DROP TABLE IF EXISTS qm.%I', r.stage_table);
    END IF;
    t := 'spark_stage_' || nextval('qm.spark_stage_seq');
    -- no index, no constraint: the tasks only append, and a retried task may append its rows again
    EXECUTE format($ddl$CREATE UNLOGGED TABLE qm.%I (
        row_key    bigint NOT NULL,
        tenant     text,
        partition  smallint,
        payload    text,
        fire_at_us bigint,
        dedup_key  text,
        reason     text
    ) WITH (autovacuum_enabled = off)$ddl$, t);
    EXECUTE format('COMMENT ON TABLE qm.%I IS %L', t, format('staging of Spark run %s into queue %s', run, queue_name));
    UPDATE qm.spark_runs
       SET state = 'staging', stage_table = t, staged_rows = NULL, good_rows = NULL, rejected_rows = NULL,
           duplicate_rows = NULL, updated_at = clock_timestamp()
     WHERE run_id = run AND queue = queue_name
    RETURNING * INTO r;
    RETURN r;
END
$$;

-- Count what Spark's tasks wrote into the run's stage table and mark the run staged. Returns one
-- row per reason (NULL: the good rows): the distinct rows (by row key) and all the rows written (a
-- retried or speculative task writes its rows again; the publish keeps one per row key).
CREATE FUNCTION qm.staged_run(run text, queue_name text)
RETURNS TABLE (reason text, distinct_rows bigint, written_rows bigint)
LANGUAGE plpgsql AS $$
DECLARE
    r qm.spark_runs;
    c record;
    good bigint := 0;
    bad bigint := 0;
    written bigint := 0;
BEGIN
    SELECT * INTO r FROM qm.spark_runs s WHERE s.run_id = run AND s.queue = queue_name FOR UPDATE;
    IF NOT FOUND OR r.state NOT IN ('staging', 'staged') THEN
        RAISE EXCEPTION 'Spark run % of queue "%" is not being staged on this shard (state %)',
            quote_literal(run), queue_name, coalesce(r.state, 'none') USING ERRCODE = '55000';
    END IF;
    FOR c IN EXECUTE format('SELECT s.reason AS why, count(DISTINCT s.row_key) AS d, count(*) AS w '
                            'FROM qm.%I s GROUP BY s.reason ORDER BY s.reason NULLS FIRST', r.stage_table) LOOP
        reason := c.why;
        distinct_rows := c.d;
        written_rows := c.w;
        RETURN NEXT;
        written := written + c.w;
        IF c.why IS NULL THEN
            good := c.d;
        ELSE
            bad := bad + c.d;
        END IF;
    END LOOP;
    UPDATE qm.spark_runs s
       SET state = 'staged', staged_rows = written, good_rows = good, rejected_rows = bad,
           duplicate_rows = written - good - bad, updated_at = clock_timestamp()
     WHERE s.run_id = run AND s.queue = queue_name;
END
$$;

-- Publish the good rows of a staged run into the queue table, once: one INSERT ... SELECT (the
-- queue's verify trigger checks every row: one refused row fails the whole statement, so the shard
-- gets all of the run's good rows or none; rows whose (tenant, dedup_key) exists are skipped, as for
-- any producer), the load counters bumped by the rows inserted per partition (qm.add_load, as the
-- Python bulk producer does), the ledger marked published and the stage table dropped, all in the
-- caller's transaction. Returns the events inserted, or NULL when the run was published already.
-- two_phase: the caller will PREPARE the transaction, which PostgreSQL refuses after a NOTIFY, so
-- the verify trigger leaves its wake-up to the caller (qm.defer_wake), who sends it after COMMIT
-- PREPARED from the ledger's wake_at.
CREATE FUNCTION qm.publish_run(run text, queue_name text, two_phase boolean DEFAULT false) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    r qm.spark_runs;
    source text;
    written bigint;
    n bigint;
    parts integer[];
    counts integer[];
    earliest timestamptz;
BEGIN
    SELECT * INTO r FROM qm.spark_runs s WHERE s.run_id = run AND s.queue = queue_name FOR UPDATE;
    IF FOUND AND r.state = 'published' THEN
        RETURN NULL;
    END IF;
    IF NOT FOUND OR r.state <> 'staged' THEN
        RAISE EXCEPTION 'Spark run % of queue "%" is not staged on this shard (state %): run the job again',
            quote_literal(run), queue_name, coalesce(r.state, 'none') USING ERRCODE = '55000';
    END IF;
    IF NOT EXISTS (SELECT FROM qm.queues WHERE name = queue_name) THEN
        RAISE EXCEPTION 'queue "%" does not exist on this shard', queue_name USING ERRCODE = '42P01';
    END IF;
    IF two_phase THEN
        PERFORM set_config('qm.defer_wake', 'on', true);
    END IF;
    -- A task attempt that Spark gave up on may still commit its rows late: SHARE mode waits for it
    -- and keeps any other writer out until this transaction ends (and drops the table).
    EXECUTE format('LOCK TABLE qm.%I IN SHARE MODE', r.stage_table);
    EXECUTE format('SELECT count(*) FROM qm.%I', r.stage_table) INTO written;
    -- one row per row key; the sort only when some row was written twice
    source := CASE WHEN written > r.good_rows + r.rejected_rows
                   THEN format('(SELECT DISTINCT ON (x.row_key) x.* FROM qm.%I x ORDER BY x.row_key)', r.stage_table)
                   ELSE format('qm.%I', r.stage_table) END;
    EXECUTE format($q$
        WITH ins AS (
            INSERT INTO public.%I AS t (tenant, partition, payload, fire_at, dedup_key)
            SELECT s.tenant, s.partition, s.payload::jsonb,
                   coalesce(timestamptz 'epoch' + s.fire_at_us * interval '1 microsecond', $1), s.dedup_key
              FROM %s s
             WHERE s.reason IS NULL
            ON CONFLICT (tenant, dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING
            RETURNING t.partition, t.fire_at)
        SELECT coalesce(sum(g.c), 0), array_agg(g.partition ORDER BY g.partition), array_agg(g.c ORDER BY g.partition),
               min(g.earliest)
          FROM (SELECT i.partition, count(*)::integer AS c, min(i.fire_at) AS earliest FROM ins i GROUP BY i.partition) g
        $q$, queue_name, source)
      INTO n, parts, counts, earliest USING clock_timestamp();
    IF n > 0 THEN
        PERFORM qm.add_load(queue_name, parts, counts);
    END IF;
    EXECUTE format('DROP TABLE qm.%I', r.stage_table);
    UPDATE qm.spark_runs s
       SET state = 'published', published = n, dedup_skipped = r.good_rows - n, stage_table = NULL,
           duplicate_rows = written - r.good_rows - r.rejected_rows,
           wake_at = least(earliest, now()), updated_at = clock_timestamp()
     WHERE s.run_id = run AND s.queue = queue_name;
    RETURN n;
END
$$;

-- Give up a run's staging on this shard (its rows were rejected, or it is abandoned): the stage table
-- is dropped and the run marked abandoned; a later run with the same id stages again. Returns false
-- when there was nothing to abandon (no such run, or published).
CREATE FUNCTION qm.abandon_run(run text, queue_name text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    r qm.spark_runs;
BEGIN
    SELECT * INTO r FROM qm.spark_runs s WHERE s.run_id = run AND s.queue = queue_name FOR UPDATE;
    IF NOT FOUND OR r.state NOT IN ('staging', 'staged') THEN
        RETURN false;
    END IF;
    IF r.stage_table IS NOT NULL THEN
        EXECUTE format('DROP TABLE IF EXISTS qm.%I', r.stage_table);
    END IF;
    UPDATE qm.spark_runs s SET state = 'abandoned', stage_table = NULL, updated_at = clock_timestamp()
     WHERE s.run_id = run AND s.queue = queue_name;
    RETURN true;
END
$$;

-- Abandon the staging of every run left staging or staged for longer than `older_than` (a job that
-- died and was never run again). A run whose ledger row is locked (a publish in progress, a prepared
-- transaction waiting for recovery) or whose stage table a task still writes is left for next time.
-- Returns the runs abandoned.
CREATE FUNCTION qm.cleanup_spark_runs(older_than interval) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    r qm.spark_runs;
    n integer := 0;
BEGIN
    FOR r IN SELECT * FROM qm.spark_runs s
              WHERE s.state IN ('staging', 'staged') AND s.updated_at < clock_timestamp() - older_than
              ORDER BY s.updated_at
                FOR UPDATE SKIP LOCKED LOOP
        BEGIN
            PERFORM set_config('lock_timeout', '1s', true);
            IF r.stage_table IS NOT NULL THEN
                EXECUTE format('DROP TABLE IF EXISTS qm.%I', r.stage_table);
            END IF;
            UPDATE qm.spark_runs s SET state = 'abandoned', stage_table = NULL, updated_at = clock_timestamp()
             WHERE s.run_id = r.run_id AND s.queue = r.queue;
            n := n + 1;
        EXCEPTION WHEN lock_not_available THEN
            NULL;  -- a task of that run still writes its stage table: next time
        END;
    END LOOP;
    RETURN n;
END
$$;

-- As revision 0005's, but for the verify trigger's wake-up (qm.defer_wake, see the header).
CREATE OR REPLACE FUNCTION qm.apply_queue(queue_id integer) RETURNS void
LANGUAGE plpgsql AS $apply$
DECLARE
    q qm.queues;
    s qm.shard;
    t text;
    n integer;
    k integer;
    w integer;
    per integer;
    words text := '';
    size_j integer;
    seqs regclass[] := '{}';
    dseqs regclass[] := '{}';
    seq_name text;
    seqs_literal text;
    dseqs_literal text;
    fresh text;
    valid text;
    member text;
    picks text := '';
    keys text[] := '{}';
    lo_arr integer[];
    off_arr integer[];
    size_arr integer[];
    route_body text;
    verify_body text;
    no_identity text := 'RAISE EXCEPTION ''this database has no shard identity yet'' USING ERRCODE = ''55000'', '
                        'HINT = ''run: qm migrate --topology <file>'';';
BEGIN
    SELECT * INTO STRICT q FROM qm.queues WHERE id = queue_id;
    SELECT * INTO s FROM qm.shard;
    t := format('public.%I', q.name);
    n := q.partitions;
    k := q.shuffle;
    w := CASE WHEN k <= 8 THEN 7 ELSE 4 END;  -- routing.draw_width
    per := 16 / w;                             -- draws per 16-digit word of the draw hash

    FOR p IN 0 .. q.partitions_physical - 1 LOOP
        seq_name := format('q%s_p%s_enq', q.id, p);
        EXECUTE format('CREATE SEQUENCE IF NOT EXISTS qm.%I', seq_name);
        seqs := seqs || format('qm.%I', seq_name)::regclass;
        -- the published done counter may be set to any value, 0 included (qm.reconcile_load)
        seq_name := format('q%s_p%s_done', q.id, p);
        EXECUTE format('CREATE SEQUENCE IF NOT EXISTS qm.%I MINVALUE -9223372036854775808 START 0', seq_name);
        dseqs := dseqs || format('qm.%I', seq_name)::regclass;
    END LOOP;
    FOR p IN q.partitions_physical .. 1023 LOOP
        EXIT WHEN to_regclass(format('qm.q%s_p%s_enq', q.id, p)) IS NULL;
        EXECUTE format('DROP SEQUENCE qm.%I, qm.%I', format('q%s_p%s_enq', q.id, p), format('q%s_p%s_done', q.id, p));
    END LOOP;
    UPDATE qm.queues SET enq_seqs = seqs, done_seqs = dseqs WHERE id = queue_id;
    -- by name, so that the generated code survives a dump and restore (a session resolves the
    -- names once, when it first plans the code)
    seqs_literal := format('%L::regclass[]', seqs::text[]::text);
    dseqs_literal := format('%L::regclass[]', dseqs::text[]::text);

    -- The rules every new row must pass, as expressions over a row variable (%1$s) and a hash of
    -- its tenant (%2$s: md5 in `valid`, whose range checks read the keyspace id; sha256 in `member`). `valid` holds for a fresh, well-formed row of this shard; `member`
    -- for a partition in the tenant's shuffle set, by the closed formula of routing.py: partition
    -- p lies in group j and must equal that group's pick. Constant arrays give, per partition,
    -- the group's first partition, the 1-based offset of its draw in the tenant's sha256 (hex) and
    -- the group's size.
    fresh := '%1$s.state = ''to_be_fired'' AND %1$s.attempts = 0 AND %1$s.fired_at IS NULL '
             'AND %1$s.acked_at IS NULL AND %1$s.ack_deadline IS NULL';
    valid := fresh || format(' AND %%1$s.tenant <> '''' AND %%1$s.fire_at >= ''2000-01-01'' '
                             'AND %%1$s.fire_at <= now() + %L::interval AND pg_column_size(%%1$s.payload) <= %s',
                             q.max_delay_seconds || ' seconds', q.payload_limit_bytes);
    IF s.range_start <> '' THEN
        valid := valid || format(' AND %%2$s COLLATE "C" >= %L', s.range_start);
    END IF;
    IF s.range_end <> '' THEN
        valid := valid || format(' AND %%2$s COLLATE "C" < %L', s.range_end);
    END IF;
    SELECT array_agg((g.j * n) / k ORDER BY p), array_agg(1 + 16 * (g.j / per) + w * (g.j % per) ORDER BY p),
           array_agg(((g.j + 1) * n) / k - (g.j * n) / k ORDER BY p)
      INTO lo_arr, off_arr, size_arr
      FROM generate_series(0, n - 1) p
     CROSS JOIN LATERAL (SELECT ((p + 1) * k - 1) / n AS j) g;
    member := format('%%1$s.partition >= 0 AND %%1$s.partition < %s AND %%1$s.partition - (%L::integer[])[%%1$s.partition + 1] = '
                     '(''x'' || substr(%%2$s, (%L::integer[])[%%1$s.partition + 1], %s))::bit(%s)::integer'
                     ' %%%% (%L::integer[])[%%1$s.partition + 1]',
                     n, lo_arr, off_arr, w, w * 4, size_arr);

    -- Routing: b<i> is the 64-bit value of the i-th 16-digit word of the tenant's sha256 (hex);
    -- group j's draw (w hex digits at digit o = w * (j mod per) of word j div per) is bits
    -- [64 - 4(o + w), 64 - 4o) of that word, and its pick (+ 1) is c<j> = lo_j + 1 + draw mod size_j
    -- (for a power-of-two size_j that is draw & (size_j - 1): one operator less per pick).
    -- With load * 2048 + c as key, least() gives the least-loaded pick, ties to the lowest partition.
    -- load = enqueue counter - published done counter, both sequences: reading a sequence is a
    -- function call in the same expression, where reading qm.queue_load would be a query.
    FOR i IN 0 .. (k - 1) / per LOOP
        words := words || format(E'    b%s := (''x'' || substr(g, %s, 16))::bit(64)::bigint;\n', i, 1 + 16 * i);
    END LOOP;
    FOR j IN 0 .. k - 1 LOOP
        size_j := ((j + 1) * n) / k - (j * n) / k;
        picks := picks || format(E'    c%s := %s + ', j, (j * n) / k + 1)
                 || CASE WHEN size_j & (size_j - 1) = 0
                         THEN format(E'((b%s >> %s) & %s);\n', j / per, 64 - 4 * (w * (j % per) + w), size_j - 1)
                         ELSE format(E'((b%s >> %s) & %s) %% %s;\n', j / per, 64 - 4 * (w * (j % per) + w),
                                     (1::bigint << (4 * w)) - 1, size_j)
                    END;
        keys := keys || format('(coalesce(pg_sequence_last_value(seqs[c%1$s]), 0) '
                               '- coalesce(pg_sequence_last_value(dseqs[c%1$s]), 0)) * 2048 + c%1$s', j);
    END LOOP;

    IF s.name IS NULL THEN
        route_body := E'BEGIN\n    ' || no_identity || E'\nEND';
        verify_body := E'BEGIN\n    ' || no_identity || E'\nEND';
    ELSE
        route_body := format($f$DECLARE
    seqs CONSTANT regclass[] := %8$s;  -- enqueue counters, index partition + 1
    dseqs CONSTANT regclass[] := %9$s;  -- published done counters, index partition + 1
    g text;
    b bigint;
    %1$s
BEGIN
    IF (%2$s AND NEW.dedup_key IS NULL) IS NOT TRUE THEN
        IF (%2$s) IS NOT TRUE THEN
            PERFORM qm.refuse_event(%3$s, NEW.tenant, NULL, NEW.fire_at, (%4$s), pg_column_size(NEW.payload), true);
        END IF;
        -- a dedup key: serialise producers of the same key; READ COMMITTED then sees a committed twin
        PERFORM pg_advisory_xact_lock(%3$s, hashtext(NEW.tenant || chr(31) || NEW.dedup_key));
        PERFORM FROM %5$s x WHERE x.tenant = NEW.tenant AND x.dedup_key = NEW.dedup_key;
        IF FOUND THEN
            RETURN NULL;  -- an event with this dedup key exists: the insert does nothing
        END IF;
    END IF;
    g := encode(sha256(convert_to(NEW.tenant, 'UTF8')), 'hex');
%6$s%7$s    b := nextval(seqs[NEW.partition + 1]);  -- an assignment, not PERFORM: no query
    RETURN NEW;
END$f$,
            (SELECT string_agg(format('c%s integer;', j), ' ') FROM generate_series(0, k - 1) j)
            || (SELECT string_agg(format(' b%s bigint;', i), '') FROM generate_series(0, (k - 1) / per) i),
            format(valid, 'NEW', 'md5(NEW.tenant)'), q.id, format(fresh, 'NEW'), t, words || picks,
            CASE WHEN k = 1 THEN E'    NEW.partition := c0 - 1;\n'
                 ELSE format(E'    NEW.partition := (least(%s) & 2047) - 1;\n', array_to_string(keys, E',\n        '))
            END,
            seqs_literal, dseqs_literal);
        verify_body := format($f$BEGIN
    PERFORM FROM qm_new r WHERE (%1$s) IS NOT TRUE LIMIT 1;
    IF FOUND THEN
        SELECT r.tenant, r.partition, r.fire_at, (%2$s) AS fresh, pg_column_size(r.payload) AS payload_bytes
          INTO bad FROM qm_new r WHERE (%1$s) IS NOT TRUE LIMIT 1;
        PERFORM qm.refuse_event(%3$s, bad.tenant, bad.partition, bad.fire_at, bad.fresh, bad.payload_bytes, false);
    END IF;
    -- Wake a waiting manager (the shared try fails while it holds the lock, or waits for it). Rows
    -- whose fire_at is older than their insert by more than a moment are always announced: the
    -- manager's picks start at what it has already fired, and only the notice tells it to look
    -- further back. The payload: '<queue> due|at <t>', t in epoch microseconds the earliest fire_at
    -- of the statement's rows or the transaction's start, whichever is earlier (so that the
    -- statements of one transaction send the same text, which PostgreSQL folds into one
    -- notification), 'due' when every row is due now (a direct fire, no rescan).
    IF NOT pg_try_advisory_xact_lock_shared(%5$s, %3$s)
       OR EXISTS (SELECT FROM qm_new r WHERE r.fire_at < clock_timestamp() - interval '%6$s milliseconds') THEN
        -- a two-phase publish (qm.publish_run) sends the wake-up itself after COMMIT PREPARED:
        -- PostgreSQL refuses to PREPARE a transaction that has sent a NOTIFY
        IF current_setting('qm.defer_wake', true) IS DISTINCT FROM 'on' THEN
            PERFORM pg_notify('qm_wake', %4$L || CASE WHEN bool_or(r.fire_at > clock_timestamp()) THEN ' at ' ELSE ' due ' END
                                         || (extract(epoch FROM least(min(r.fire_at), now())) * 1000000)::bigint)
               FROM qm_new r;
        END IF;
    END IF;
    RETURN NULL;
END$f$,
            format(valid, 'r', 'md5(r.tenant)') || ' AND '
            || format(member, 'r', 'encode(sha256(convert_to(r.tenant, ''UTF8'')), ''hex'')'),
            format(fresh, 'r'), q.id, q.name, qm.wake_lock_key(), qm.backdated_ms());
    END IF;

    EXECUTE format($f$CREATE OR REPLACE FUNCTION qm.%1$I() RETURNS trigger
LANGUAGE plpgsql AS $route$
-- Generated by qm.apply_queue(%2$s) for queue %3$I (N = %4$s, k = %5$s). Do not edit: apply_queue
-- rewrites it whenever the settings or the topology change.
-- Validates a row whose partition is left to the database, then writes the least-loaded
-- partition of the tenant's shuffle set (load = enqueue counter - done counter).
%6$s
$route$$f$, format('q%s_route', q.id), q.id, q.name, n, k, route_body);

    EXECUTE format($f$CREATE OR REPLACE FUNCTION qm.%1$I() RETURNS trigger
LANGUAGE plpgsql AS $verify$
-- Generated by qm.apply_queue(%2$s) for queue %3$I (N = %4$s, k = %5$s). Do not edit.
-- Checks every row the statement inserted (transition table qm_new) in one pass, then wakes the
-- manager if it is waiting. A waiting manager holds the exclusive advisory lock (qm.wake_lock_key(),
-- queue id); producers try the shared form. If the try fails, the manager waits and must be told;
-- if it succeeds, the manager takes the exclusive lock only after this transaction ends, and its
-- next scan sees these rows. So no wake-up is lost, and a producer pays NOTIFY's commit lock only
-- when a manager is idle (one NOTIFY per statement, folded by PostgreSQL per transaction).
DECLARE
    bad record;
%6$s
$verify$$f$, format('q%s_verify', q.id), q.id, q.name, n, k, verify_body);

    -- The rule for UPDATEs that make an event fresh again (attempts back to 0, as qm events retry
    -- does): its partition must be one of [0, N). After a shrink, an event beyond N would sit in
    -- a partition no manager scans. A BEFORE UPDATE OF attempts, partition row trigger with the
    -- rule as WHEN clause, not a CHECK constraint: PostgreSQL prepares a CHECK for every INSERT
    -- statement too (about 4 us of a single-row insert), while this one is prepared only by
    -- UPDATEs that set one of the two columns. Rows with attempts > 0 are exempt, so draining a
    -- shrinking queue never trips it. The error carries the rule's name as constraint name, as
    -- the verify trigger does for a partition outside the shuffle set.
    EXECUTE format('ALTER TABLE %s DROP CONSTRAINT IF EXISTS %I', t, q.name || '_partition_in_shuffle_set');
    EXECUTE format('DROP TRIGGER IF EXISTS qm_fresh_partition ON %s', t);
    EXECUTE format('CREATE TRIGGER qm_fresh_partition BEFORE UPDATE OF attempts, partition ON %1$s FOR EACH ROW '
                   'WHEN (NEW.attempts <= 0 AND NOT (NEW.partition >= 0 AND NEW.partition < %2$s)) '
                   'EXECUTE FUNCTION qm.refuse_fresh_partition(%3$L, %2$s)', t, n, q.name);

    -- fire_at defaults to the insert's own time, not its transaction's start: an event inserted
    -- late in a long transaction is then not announced as a late row (see the verify trigger)
    EXECUTE format('ALTER TABLE %s ALTER COLUMN fire_at SET DEFAULT clock_timestamp()', t);

    -- An event in hand (fired) that anyone but the manager settles (an ack by SQL in an
    -- application transaction, a delete): the manager hears of it at commit, frees the receiver's
    -- credit slot and counts the event as done. The manager's own sessions run with qm.role =
    -- manager and are left out; the WHEN clause costs its UPDATEs one comparison per row.
    EXECUTE format('DROP TRIGGER IF EXISTS qm_settled ON %s', t);
    EXECUTE format('CREATE TRIGGER qm_settled AFTER UPDATE OF state ON %s FOR EACH ROW '
                   'WHEN (OLD.state = ''fired'' AND NEW.state <> ''fired'' '
                   'AND current_setting(''qm.role'', true) IS DISTINCT FROM ''manager'') '
                   'EXECUTE FUNCTION qm.notify_settled()', t);
    EXECUTE format('DROP TRIGGER IF EXISTS qm_settled_delete ON %s', t);
    EXECUTE format('CREATE TRIGGER qm_settled_delete AFTER DELETE ON %s FOR EACH ROW '
                   'WHEN (OLD.state = ''fired'' AND current_setting(''qm.role'', true) IS DISTINCT FROM ''manager'') '
                   'EXECUTE FUNCTION qm.notify_settled()', t);

    -- An event an application makes due again or reschedules (qm events retry, an UPDATE of
    -- fire_at) is announced like an insert: the manager's picks start after what it has fired.
    EXECUTE format('DROP TRIGGER IF EXISTS qm_rescheduled ON %s', t);
    EXECUTE format('CREATE TRIGGER qm_rescheduled AFTER UPDATE OF state, fire_at ON %s FOR EACH ROW '
                   'WHEN (NEW.state = ''to_be_fired'' AND current_setting(''qm.role'', true) IS DISTINCT FROM ''manager'') '
                   'EXECUTE FUNCTION qm.notify_rescheduled()', t);

    EXECUTE format('DROP TRIGGER IF EXISTS qm_route ON %s', t);
    EXECUTE format('CREATE TRIGGER qm_route BEFORE INSERT ON %s FOR EACH ROW WHEN (NEW.partition IS NULL) '
                   'EXECUTE FUNCTION qm.%I()', t, format('q%s_route', q.id));
    EXECUTE format('DROP TRIGGER IF EXISTS qm_verify ON %s', t);
    EXECUTE format('CREATE TRIGGER qm_verify AFTER INSERT ON %s REFERENCING NEW TABLE AS qm_new '
                   'FOR EACH STATEMENT EXECUTE FUNCTION qm.%I()', t, format('q%s_verify', q.id));
END
$apply$;


DO $$
DECLARE
    qid integer;
BEGIN
    FOR qid IN SELECT id FROM qm.queues LOOP
        PERFORM qm.apply_queue(qid);
    END LOOP;
END
$$;
