-- Take the lease of a holder that is gone (docs/manager.md, "Leadership and fencing"): the lease of
-- `from_term`, renewed last from the backend `from_pid`, when its holder has no connection left
-- (qm.holder_connected: its process died, and its connections closed with it), or any lease that
-- has expired (with NULLs for both: qm.acquire_leadership). The new lease is `holder`'s for
-- `ttl_seconds` by the database's clock, under the next term. Returns the new term, or NULL when
-- the lease moved on (a new term, or a renewal from another backend), when the holder is still
-- connected, or when the shard does not serve. The
-- caller saw the holder gone for a while first (leadership.py, DEAD_HOLDER_GRACE): a live holder
-- that lost its connections reconnects before then. Safety does not rest on this judgement but on
-- the fence, as for every takeover: FOR UPDATE waits for every fenced statement in flight, and once
-- this commits every statement of the old term is refused.
CREATE OR REPLACE FUNCTION qm.take_over_leadership(
    holder text, ttl_seconds double precision, from_term bigint, from_pid integer
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    new_term bigint;
BEGIN
    IF holder IS NULL OR holder = '' OR ttl_seconds IS NULL OR ttl_seconds <= 0 THEN
        RAISE EXCEPTION 'taking the lease needs a holder name and a positive ttl' USING ERRCODE = '22023';
    END IF;
    -- FOR UPDATE waits for every fenced statement in flight (they hold FOR KEY SHARE)
    PERFORM 1 FROM qm.leader FOR UPDATE;
    -- a shard that does not serve its range (a reshard's target before the switch, or its source
    -- after the freeze; revision 0005_reshard) grants no lease. Read after the lock, by a statement
    -- of its own: a qm.set_serving that committed before the lock was granted is seen here, and
    -- one that commits after it bumps the term of whatever lease this grants (its UPDATE of the
    -- leader row waits for this transaction and then deposes its holder)
    IF EXISTS (SELECT FROM qm.shard s WHERE s.serving <> 'serving') THEN
        RETURN NULL;
    END IF;
    UPDATE qm.leader l
       SET term = l.term + 1, holder = take_over_leadership.holder, holder_pid = pg_backend_pid(),
           acquired_at = clock_timestamp(), renewed_at = clock_timestamp(),
           expires_at = clock_timestamp() + make_interval(secs => ttl_seconds)
     WHERE l.expires_at <= clock_timestamp()
        OR (l.term = from_term AND l.holder_pid = from_pid AND NOT qm.holder_connected(l.holder, l.holder_pid))
    RETURNING l.term INTO new_term;
    RETURN new_term;
END
$$;
