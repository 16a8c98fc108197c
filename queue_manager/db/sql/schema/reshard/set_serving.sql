-- Set whether this shard serves its range ('serving', 'pending', 'frozen', 'moved'; see revision
-- 0005_reshard) and, when shards is given, the stored topology that names the right shard in
-- errors (qm.shard_map; the JSON array of qm.set_topology). Leaving 'serving' deposes the manager
-- at once: the term moves on and the lease is over (holder 'reshard'), and since qm.acquire_leadership
-- grants nothing while the shard does not serve, no manager takes it until the shard serves again.
-- The leader row's FOR UPDATE waits for every fenced statement in flight, and creating qm_moved on
-- each queue waits for every open write: when this commits, the shard's events no longer change.
-- Returns the leader term after the change.
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
    PERFORM 1 FROM qm.leader FOR UPDATE;
    UPDATE qm.shard SET serving = state, updated_at = now() RETURNING * INTO s;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'this database has no shard identity yet' USING ERRCODE = '55000',
            HINT = 'run: qm migrate --topology <file>';
    END IF;
    IF state <> 'serving' THEN
        UPDATE qm.leader l SET term = l.term + 1, holder = 'reshard', holder_pid = NULL,
                               renewed_at = clock_timestamp(), expires_at = clock_timestamp()
         WHERE l.holder IS DISTINCT FROM 'reshard' OR l.expires_at > clock_timestamp();
    END IF;
    IF shards IS NOT NULL THEN
        PERFORM qm.set_shard_map(shards);
    END IF;
    FOR q IN SELECT * FROM qm.queues ORDER BY id LOOP
        PERFORM qm.apply_reshard_triggers(q, s);
    END LOOP;
    SELECT l.term INTO new_term FROM qm.leader l;
    RETURN new_term;
END
$$;
