-- The manager's leadership lease (the row qm.leader; docs/manager.md): take the lease if it has
-- expired; returns the new term, or NULL while another holder's lease runs or the shard does not
-- serve. All lease times are the database clock's (clock_timestamp()), never a manager's. The
-- taking itself is qm.take_over_leadership's (with no holder to take over from): it locks the
-- leader row FOR UPDATE, which waits for every in-flight statement holding the KEY SHARE lock taken
-- by qm.fence; once it commits, every later qm.fence of the old term raises. A manager that stops
-- mid-transaction cannot block a takeover for long: its sessions run with
-- idle_in_transaction_session_timeout and statement_timeout.
-- While the lease runs, a plain read answers, with no row lock: a FOR UPDATE on every call queued
-- behind the leader's fenced statements in flight, held up every fenced statement that came after
-- it, and kept the row locked until its own commit was flushed (the lock is logged), so every
-- standby poll stalled the leader's fires and acks for up to two WAL flushes.
CREATE OR REPLACE FUNCTION qm.acquire_leadership(holder text, ttl_seconds double precision) RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT FROM qm.leader l WHERE l.expires_at > clock_timestamp()) THEN
        RETURN NULL;
    END IF;
    RETURN qm.take_over_leadership(holder, ttl_seconds, NULL, NULL);
END
$$;
