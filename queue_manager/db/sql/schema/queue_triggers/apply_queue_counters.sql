-- A queue's load counters: per partition p < partitions_physical, the sequences qm.q<id>_p<p>_enq
-- (events enqueued, bumped by the route trigger and qm.add_load without a row lock) and
-- qm.q<id>_p<p>_done (events that left: qm.add_done, the reconciliation), load(p) = enq - done.
-- Creates the missing ones, drops those of partitions a completed shrink gave up, records them in
-- the registry row (enq_seqs, done_seqs: element p+1 for partition p) and returns the row.
CREATE OR REPLACE FUNCTION qm.apply_queue_counters(queue_id integer) RETURNS qm.queues
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
    seqs regclass[] := '{}';
    dseqs regclass[] := '{}';
    seq_name text;
BEGIN
    SELECT * INTO STRICT q FROM qm.queues WHERE id = queue_id;
    FOR p IN 0 .. q.partitions_physical - 1 LOOP
        seq_name := format('q%s_p%s_enq', q.id, p);
        EXECUTE format('CREATE SEQUENCE IF NOT EXISTS qm.%I', seq_name);
        seqs := seqs || format('qm.%I', seq_name)::regclass;
        -- the published done counter may be set to any value, 0 included (qm.reconcile_partition).
        -- qm.add_done moves it by nextval, and the first nextval of a sequence never called returns
        -- its start without counting: so it is marked called at 0 (a no-op for every reader, which
        -- takes a NULL last value for 0), and its first nextval counts one
        seq_name := format('q%s_p%s_done', q.id, p);
        EXECUTE format('CREATE SEQUENCE IF NOT EXISTS qm.%I MINVALUE -9223372036854775808 START 0', seq_name);
        dseqs := dseqs || format('qm.%I', seq_name)::regclass;
        IF pg_sequence_last_value(dseqs[p + 1]) IS NULL THEN
            PERFORM setval(dseqs[p + 1], 0);
        END IF;
    END LOOP;
    FOR p IN q.partitions_physical .. 1023 LOOP
        EXIT WHEN to_regclass(format('qm.q%s_p%s_enq', q.id, p)) IS NULL;
        EXECUTE format('DROP SEQUENCE qm.%I, qm.%I', format('q%s_p%s_enq', q.id, p), format('q%s_p%s_done', q.id, p));
    END LOOP;
    UPDATE qm.queues SET enq_seqs = seqs, done_seqs = dseqs WHERE id = queue_id RETURNING * INTO q;
    RETURN q;
END
$$;
