-- Revision 0005: shuffle sets that reach every partition of wide groups.
--
-- The draws of a tenant's shuffle set come from sha256 of its UTF-8 bytes instead of the second
-- half of its md5: 7 hex digits per draw up to k = 8, 4 beyond, never straddling a 16-digit word
-- (queue_manager/domain/routing.py has the rule). Before, a draw had 16 div k digits, so a group
-- wider than its draw's range had partitions no tenant could use (N = 1024, k = 16: 256 of 1 024).
-- The shard of a tenant (md5's first half) does not change.
--
--   qm.draw_hex()      the draw hash, as the generated code computes it inline
--   qm.shuffle_set()   the new rule (used by qm.refuse_event's messages and by tests)
--   qm.apply_queue()   the same code as revision 0004's, except the routing and verify
--                      triggers' draws
--
-- Applied to every existing queue at the end. Events stored before stay in their partitions:
-- nothing checks a stored row's shuffle set again (the qm_fresh_partition rule only asks for a
-- partition in [0, N) when an event is made fresh), the manager dispatches every partition, and
-- only rows inserted afterwards follow the new sets.

CREATE FUNCTION qm.draw_hex(tenant text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN encode(sha256(convert_to(tenant, 'UTF8')), 'hex');

-- The tenant's shuffle set (ascending), as specified in routing.py.
CREATE OR REPLACE FUNCTION qm.shuffle_set(tenant text, n integer, k integer) RETURNS smallint[]
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
    g text := qm.draw_hex(tenant);
    w integer := CASE WHEN k <= 8 THEN 7 ELSE 4 END;
    per integer := 16 / w;
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
        picks := picks || (lo + ('x' || lpad(substr(g, 1 + 16 * (j / per) + w * (j % per), w), 8, '0'))::bit(32)::integer
                                % (hi - lo))::smallint;
    END LOOP;
    RETURN picks;
END
$$;

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
        PERFORM pg_notify('qm_wake', %4$L || CASE WHEN bool_or(r.fire_at > clock_timestamp()) THEN ' at ' ELSE ' due ' END
                                     || (extract(epoch FROM least(min(r.fire_at), now())) * 1000000)::bigint)
           FROM qm_new r;
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
