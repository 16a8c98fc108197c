-- End the lease at once, so that a standby takes over without waiting for it to expire.
CREATE OR REPLACE FUNCTION qm.release_leadership(holder text, term bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE qm.leader l SET expires_at = clock_timestamp()
     WHERE l.term = release_leadership.term AND l.holder = release_leadership.holder;
    RETURN FOUND;
END
$$;
