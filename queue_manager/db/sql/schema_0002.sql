-- Revision 0002: the manager's leadership lease and its fencing.
--
--   qm.leader                 one row per shard database: the current term, who holds it, until when
--   qm.acquire_leadership()   take the lease if it has expired; returns the new term (or NULL)
--   qm.renew_leadership()     extend the lease of (holder, term); false once the term is gone
--   qm.release_leadership()   end the lease at once so a standby takes over without waiting
--   qm.fence(term)            called by every fire, ack and re-fire statement of the manager: it
--                             share-locks the leader row while the term is current and raises
--                             otherwise, so a deposed manager's writes are refused by the database
--
-- All lease times are the database clock's (clock_timestamp()), never a manager's clock. A takeover
-- locks the leader row FOR UPDATE, which waits for every in-flight statement holding the KEY SHARE
-- lock taken by qm.fence; once it commits, every later qm.fence of the old term raises. A manager that stops
-- mid-transaction cannot block a takeover for long: its sessions run with
-- idle_in_transaction_session_timeout and statement_timeout.

CREATE TABLE qm.leader (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    term        bigint NOT NULL DEFAULT 0,
    holder      text,
    holder_pid  integer,
    acquired_at timestamptz,
    renewed_at  timestamptz,
    expires_at  timestamptz NOT NULL DEFAULT '-infinity'
);
INSERT INTO qm.leader DEFAULT VALUES;

CREATE FUNCTION qm.acquire_leadership(holder text, ttl_seconds double precision) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    new_term bigint;
BEGIN
    IF holder IS NULL OR holder = '' OR ttl_seconds IS NULL OR ttl_seconds <= 0 THEN
        RAISE EXCEPTION 'acquire_leadership needs a holder name and a positive ttl' USING ERRCODE = '22023';
    END IF;
    -- FOR UPDATE waits for every fenced statement in flight (they hold FOR KEY SHARE)
    PERFORM 1 FROM qm.leader FOR UPDATE;
    UPDATE qm.leader l
       SET term = l.term + 1, holder = acquire_leadership.holder, holder_pid = pg_backend_pid(),
           acquired_at = clock_timestamp(), renewed_at = clock_timestamp(),
           expires_at = clock_timestamp() + make_interval(secs => ttl_seconds)
     WHERE l.expires_at <= clock_timestamp()
    RETURNING l.term INTO new_term;
    RETURN new_term;
END
$$;

CREATE FUNCTION qm.renew_leadership(holder text, term bigint, ttl_seconds double precision) RETURNS boolean
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

CREATE FUNCTION qm.release_leadership(holder text, term bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE qm.leader l SET expires_at = clock_timestamp()
     WHERE l.term = release_leadership.term AND l.holder = release_leadership.holder;
    RETURN FOUND;
END
$$;

-- Fencing: raise unless `term` is the current, unexpired lease; otherwise hold a KEY SHARE lock on
-- the leader row until the calling transaction ends. A takeover (SELECT ... FOR UPDATE in
-- qm.acquire_leadership) waits for it; a renewal (a non-key UPDATE) does not, so a fenced
-- statement that waits on an application's row lock cannot make its own manager's lease lapse.
CREATE FUNCTION qm.fence(term bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    current_term bigint;
    current_expiry timestamptz;
BEGIN
    SELECT l.term, l.expires_at INTO current_term, current_expiry FROM qm.leader l FOR KEY SHARE;
    IF current_term IS DISTINCT FROM fence.term OR current_expiry <= clock_timestamp() THEN
        RAISE EXCEPTION 'manager term % is no longer current (current term %, lease %)', fence.term, current_term,
            CASE WHEN current_expiry <= clock_timestamp() THEN 'expired' ELSE 'held' END
            USING ERRCODE = 'QMF01', HINT = 'this manager was deposed; it must stop dispatching';
    END IF;
    RETURN current_term;
END
$$;

-- Bump the per-partition "done" counters of a queue (qm.queue_load) by the partitions of
-- events that left the queue (acked or dead-lettered), and publish them to the done sequences;
-- `parts` holds one entry per event.
CREATE FUNCTION qm.add_done(queue_id integer, parts smallint[]) RETURNS void
LANGUAGE sql AS $$
    UPDATE qm.queue_load l
       SET done = (SELECT array_agg(coalesce(l.done[i], 0) + coalesce(c.cnt, 0) ORDER BY i)
                     FROM generate_series(1, greatest(cardinality(l.done), (SELECT max(p) + 1 FROM unnest(parts) p))) i
                     LEFT JOIN (SELECT p + 1 AS idx, count(*) AS cnt FROM unnest(parts) p GROUP BY p) c ON c.idx = i)
     WHERE l.queue_id = add_done.queue_id AND cardinality(parts) > 0;
    -- under the row lock just taken: the routing trigger reads the sequences
    SELECT qm.publish_done(add_done.queue_id, parts) WHERE cardinality(parts) > 0;
$$;

-- Back-off before attempt `attempts + 1`: exponential from min, jittered by +-33 %, within [min, max].
CREATE FUNCTION qm.backoff_seconds(attempts integer, min_s double precision, max_s double precision) RETURNS double precision
LANGUAGE sql VOLATILE PARALLEL SAFE
RETURN least(max_s, greatest(min_s, least(max_s, min_s * power(2.0, least(greatest(attempts - 1, 0), 60))) * (0.67 + random() * 0.66)));
