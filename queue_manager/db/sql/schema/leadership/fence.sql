-- Fencing, called by every fire, ack and re-fire statement of the manager: raise unless `term` is
-- the current, unexpired lease; otherwise hold a KEY SHARE lock on the leader row until the calling
-- transaction ends. A takeover (SELECT ... FOR UPDATE in qm.acquire_leadership) waits for it; a
-- renewal (a non-key UPDATE) does not, so a fenced statement that waits on an application's row
-- lock cannot make its own manager's lease lapse. A deposed manager's writes are refused by the
-- database.
CREATE OR REPLACE FUNCTION qm.fence(term bigint) RETURNS bigint
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
