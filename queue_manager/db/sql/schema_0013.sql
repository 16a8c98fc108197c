-- Revision 0013_enqueue_lock: a reconciliation slice sees the enqueues that are not committed yet.
--
-- The race it closes: an enqueue bumps its partition's enqueue counter (nextval, not
-- transactional) before its transaction commits. A reconciliation slice (qm.reconcile_partition)
-- that counted the partition in that gap saw the bump but not the row, counted the event as done
-- (done := enq - live), and once the event was acked it was counted done a second time: the
-- partition's load stayed too low until the next slice (-3 to -6 in a test that runs slices
-- beside 20-row inserts).
--
--   qm.enq_lock_key()      the advisory lock (qm.enq_lock_key(), queue id * 64 + partition % 64):
--                          every enqueue that bumps a partition's counter holds it *shared* from
--                          before the bump to the end of its transaction; a slice *tries* it
--                          exclusively, and gives up while a transaction that enqueued into the
--                          partition is open. Partitions share a lock by partition % 64: a
--                          transaction that enqueues into every partition of a wide queue (a
--                          Spark publish into 1 024) then holds at most 64 of them, since
--                          advisory locks take room in the shared lock table (sized by
--                          max_locks_per_transaction); two partitions that share a lock only make
--                          a slice give up more often
--   qm.apply_queue()       revision 0007's, the route trigger's counter bump preceded by the lock
--                          (a patch of that one line, below); reapplied to every queue
--   qm.add_load()          the same for a bulk load's bumps, one lock per partition
--   qm.reconcile_partition()  revision 0009's, with the enqueue lock
--   qm.reconcile_load()    the same for the whole queue: it waits for the ack statements as before
--                          and raises lock_not_available (55P03) while an enqueue is open (waiting
--                          for the enqueue locks could deadlock with a producer that holds one
--                          partition's and waits for another's)
--
-- Why the slice is then exact: it takes the partition's lock (L), counts the live events (a
-- snapshot taken after L) and reads the enqueue counter (E), all under the lock. A producer's bump
-- in E was made under its shared lock. It cannot have taken that lock after L (the slice holds it
-- exclusively until after E), so it took it before L; the slice's try succeeded, so the producer
-- had released it, which a transaction does after its commit became visible: the count sees its
-- row. A producer that meets a slice waits for it: at most one partition's count, bounded by the
-- slice's statement timeout, as an ack statement waits for the load lock. It first *tries* the
-- lock (a plain call in the trigger's expression, no query; after the first row of a
-- (transaction, partition) a local lookup); only a failed try waits.
--
-- A first attempt let a producer that met a slice go on without the lock and told the slice
-- through a sequence; a producer that had met one slice then held no lock through the next one,
-- and test_slices_beside_slow_committing_enqueues_leave_the_counters_exact
-- (tests/integration/test_load_counters.py) still drifted in 2 runs of 8.

CREATE FUNCTION qm.enq_lock_key() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN 29040;

-- The route trigger's counter bump, in qm.apply_queue's generated code. A patch of that one line
-- rather than a copy of the whole function: the rest of revision 0007's qm.apply_queue stands.
-- %3$s is the queue id in the format() call that builds the trigger (%% is a literal % there); the
-- key is the one the functions below use, queue id * 64 + partition % 64.
DO $patch$
DECLARE
    src text;
    old_line CONSTANT text := E'%6$s%7$s    b := nextval(seqs[NEW.partition + 1]);  -- an assignment, not PERFORM: no query\n';
    new_lines CONSTANT text :=
        E'%6$s%7$s    -- the partition''s enqueue lock, shared to the end of the transaction; held exclusively, a\n'
        || E'    -- reconciliation slice is counting the partition: wait for it (revision 0013_enqueue_lock)\n'
        || E'    IF NOT pg_try_advisory_xact_lock_shared(' || qm.enq_lock_key() || E', %3$s * 64 + NEW.partition %% 64) THEN\n'
        || E'        PERFORM pg_advisory_xact_lock_shared(' || qm.enq_lock_key() || E', %3$s * 64 + NEW.partition %% 64);\n'
        || E'    END IF;\n'
        || E'    b := nextval(seqs[NEW.partition + 1]);  -- an assignment, not PERFORM: no query\n';
BEGIN
    src := pg_get_functiondef('qm.apply_queue(integer)'::regprocedure);
    IF array_length(string_to_array(src, old_line), 1) IS DISTINCT FROM 2 THEN
        RAISE EXCEPTION 'qm.apply_queue is not revision 0007''s: its counter bump was not found once';
    END IF;
    EXECUTE replace(src, old_line, new_lines);
END
$patch$;

-- Bump the enqueue counters after a bulk load that chose its partitions itself; the enqueue lock
-- of each partition first, as the route trigger does per row.
CREATE OR REPLACE FUNCTION qm.add_load(queue_name text, partitions integer[], counts integer[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
BEGIN
    SELECT * INTO q FROM qm.queues WHERE name = queue_name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" does not exist on this shard', queue_name USING ERRCODE = '42P01';
    END IF;
    PERFORM pg_advisory_xact_lock_shared(qm.enq_lock_key(), q.id * 64 + b.bucket)
       FROM (SELECT DISTINCT part % 64 AS bucket FROM unnest(partitions) AS u(part)
              WHERE part >= 0 AND part < cardinality(q.enq_seqs)) b;
    PERFORM nextval(q.enq_seqs[p.part + 1])
       FROM unnest(partitions, counts) AS p(part, cnt), generate_series(1, p.cnt)
      WHERE p.part >= 0 AND p.part < cardinality(q.enq_seqs);
END
$$;

-- One partition's reconciliation: afterwards load(part) = its live events (to_be_fired + fired).
-- Returns {load before, live events}. Raises lock_not_available (55P03) at once, without waiting
-- and without changing the counter, when an ack statement holds the queue's load lock or a
-- transaction that enqueued into the partition is still open: the slice is aborted, not retried,
-- and a later slice does the partition. The count reads one partition of the <queue>_due index
-- and the <queue>_fired index (no acked row).
CREATE OR REPLACE FUNCTION qm.reconcile_partition(queue_name text, part integer) RETURNS bigint[]
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
    IF NOT pg_try_advisory_xact_lock(qm.enq_lock_key(), q.id * 64 + part % 64) THEN
        RAISE EXCEPTION 'a transaction that enqueued into partition % of queue "%" (or one that shares its lock) is still open', part, queue_name
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

-- The whole queue's reconciliation (tests, benchmarks, an operator): it waits for the ack
-- statements in progress, and raises lock_not_available (55P03) without changing a counter while a
-- transaction that enqueued into the queue is open: call it again once it ended. Under those locks
-- each partition is reconciled as a slice does it (qm.reconcile_partition takes them again, which
-- the same transaction always can); returns the live events per partition.
CREATE OR REPLACE FUNCTION qm.reconcile_load(queue_name text) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
    held integer;
    live bigint[];
BEGIN
    SELECT * INTO q FROM qm.queues WHERE name = queue_name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" does not exist on this shard', queue_name USING ERRCODE = '42P01';
    END IF;
    PERFORM pg_advisory_xact_lock(qm.load_lock_key(), q.id);
    SELECT min(p) INTO held FROM generate_series(0, least(q.partitions_physical, 64) - 1) p
     WHERE NOT pg_try_advisory_xact_lock(qm.enq_lock_key(), q.id * 64 + p);
    IF held IS NOT NULL THEN
        RAISE EXCEPTION 'a transaction that enqueued into partition % of queue "%" (or one that shares its lock) is still open', held, queue_name
            USING ERRCODE = '55P03', HINT = 'call qm.reconcile_load again once it ended';
    END IF;
    SELECT array_agg((qm.reconcile_partition(queue_name, p))[2] ORDER BY p) INTO live
      FROM generate_series(0, q.partitions_physical - 1) p;
    RETURN live;
END
$$;

SELECT qm.apply_queue(id) FROM qm.queues ORDER BY id;
