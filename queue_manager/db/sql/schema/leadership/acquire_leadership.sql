-- The manager's leadership lease (the row qm.leader; docs/manager.md): take the lease if it has
-- expired; returns the new term, or NULL while another holder's lease runs or the shard does not
-- serve. All lease times are the database clock's (clock_timestamp()), never a manager's. A
-- takeover locks the leader row FOR UPDATE, which waits for every in-flight statement holding the
-- KEY SHARE lock taken by qm.fence; once it commits, every later qm.fence of the old term raises.
-- A manager that stops mid-transaction cannot block a takeover for long: its sessions run with
-- idle_in_transaction_session_timeout and statement_timeout.
CREATE OR REPLACE FUNCTION qm.acquire_leadership(holder text, ttl_seconds double precision) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    new_term bigint;
BEGIN
    IF holder IS NULL OR holder = '' OR ttl_seconds IS NULL OR ttl_seconds <= 0 THEN
        RAISE EXCEPTION 'acquire_leadership needs a holder name and a positive ttl' USING ERRCODE = '22023';
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
       SET term = l.term + 1, holder = acquire_leadership.holder, holder_pid = pg_backend_pid(),
           acquired_at = clock_timestamp(), renewed_at = clock_timestamp(),
           expires_at = clock_timestamp() + make_interval(secs => ttl_seconds)
     WHERE l.expires_at <= clock_timestamp()
    RETURNING l.term INTO new_term;
    RETURN new_term;
END
$$;
