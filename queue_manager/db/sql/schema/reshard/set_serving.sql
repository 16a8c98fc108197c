-- Set whether this shard serves its range ('serving', 'pending', 'frozen', 'moved'; see revision
-- 0005_reshard) and, when shards is given, the stored topology that names the right shard in
-- errors (qm.shard_map; the JSON array of qm.set_topology). Leaving 'serving' deposes the manager
-- at once: the term moves on and the lease is over (holder 'reshard'), and since qm.acquire_leadership
-- grants nothing while the shard does not serve, no manager takes it until the shard serves again.
-- Returns the leader term after the change.
--
-- Lock order (docs/operations.md, "The cut-over, and what blocks for how long"): the qm.shard row
-- (locked by the reshard's own functions only), then the queue tables in qm.queues id order, then
-- the qm.leader row last, as every fenced statement of the manager takes them (an UPDATE or DELETE
-- locks its queue table when it starts, then qm.fence locks the leader row FOR KEY SHARE). Leaving 'serving' takes each queue table in
-- SHARE ROW EXCLUSIVE mode, which waits for every open write of an event, the manager's fenced
-- ones included, and holds new ones back until this commits; the term bump then needs no lock that
-- a fenced statement holds (an UPDATE of the term conflicts with FOR KEY SHARE only if it changed
-- the row's key). Once this commits, no event of the shard changes any more: other writers meet
-- qm_moved, and the manager's next fenced statement sees the new term.
CREATE OR REPLACE FUNCTION qm.set_serving(state text, shards jsonb DEFAULT NULL) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    s qm.shard;
    q qm.queues;
    new_term bigint;
BEGIN
    IF state IS NULL OR state NOT IN ('serving', 'pending', 'frozen', 'moved') THEN
        RAISE EXCEPTION 'serving state must be serving, pending, frozen or moved, got %', quote_nullable(state)
            USING ERRCODE = '22023';
    END IF;
    UPDATE qm.shard SET serving = state, updated_at = now() RETURNING * INTO s;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'this database has no shard identity yet' USING ERRCODE = '55000',
            HINT = 'run: qm migrate --topology <file>';
    END IF;
    FOR q IN SELECT * FROM qm.queues ORDER BY id LOOP
        IF state <> 'serving' THEN
            EXECUTE format('LOCK TABLE public.%I IN SHARE ROW EXCLUSIVE MODE', q.name);
        END IF;
        PERFORM qm.apply_reshard_triggers(q, s);
    END LOOP;
    IF state <> 'serving' THEN
        UPDATE qm.leader l SET term = l.term + 1, holder = 'reshard', holder_pid = NULL,
                               renewed_at = clock_timestamp(), expires_at = clock_timestamp()
         WHERE l.holder IS DISTINCT FROM 'reshard' OR l.expires_at > clock_timestamp();
    END IF;
    IF shards IS NOT NULL THEN
        PERFORM qm.set_shard_map(shards);
    END IF;
    SELECT l.term INTO new_term FROM qm.leader l;
    RETURN new_term;
END
$$;
