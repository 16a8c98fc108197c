-- Extend the lease of (holder, term); false once the term is gone.
CREATE OR REPLACE FUNCTION qm.renew_leadership(holder text, term bigint, ttl_seconds double precision) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    -- renewing needs the same term and holder; a lapsed lease that nobody took over may be
    -- renewed, since no other manager acted in between (the term did not move)
    UPDATE qm.leader l
       SET renewed_at = clock_timestamp(), holder_pid = pg_backend_pid(),
           expires_at = clock_timestamp() + make_interval(secs => ttl_seconds)
     WHERE l.term = renew_leadership.term AND l.holder = renew_leadership.holder;
    RETURN FOUND;
END
$$;
