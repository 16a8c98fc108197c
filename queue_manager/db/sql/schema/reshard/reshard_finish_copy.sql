-- The last step of a reshard's copy on a receiving shard, once its origins are frozen and every
-- change is applied, before it serves: every queue's id sequence above every id in use (the copy
-- wrote ids past it) and above the origins' sequences (min_ids: {queue: last id issued}, so that
-- no id an origin gave out is given out again here), and the leader term above min_term (the
-- origins' terms, which the copied fired rows carry). The load counters are reconciled after the
-- shard serves (qm.reconcile_load, outside the cut-over: the loads are approximate by design, and
-- the manager's reconciliation slices correct them anyway).
CREATE OR REPLACE FUNCTION qm.reshard_finish_copy(min_term bigint, min_ids jsonb) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
    t text;
    top bigint;
BEGIN
    FOR q IN SELECT * FROM qm.queues ORDER BY id LOOP
        t := format('public.%I', q.name);
        EXECUTE format('SELECT greatest((SELECT max(id) FROM %s), (SELECT max(local_id) FROM qm.reshard_rows WHERE queue = $1), $2)', t)
          INTO top USING q.name, (min_ids->>q.name)::bigint;
        IF top IS NOT NULL THEN
            PERFORM setval(pg_get_serial_sequence(t, 'id'),
                           greatest(top, (SELECT last_value FROM pg_sequences
                                           WHERE format('%I.%I', schemaname, sequencename)::regclass
                                                 = pg_get_serial_sequence(t, 'id')::regclass)));
        END IF;
    END LOOP;
    UPDATE qm.leader l SET term = min_term WHERE l.term < min_term;
END
$$;
