-- The triggers on a queue's table (see qm.apply_queue), dropped and created again so that they
-- name the current settings and functions:
--   qm_route            BEFORE INSERT FOR EACH ROW WHEN (NEW.partition IS NULL): qm.q<id>_route()
--   qm_verify           AFTER INSERT FOR EACH STATEMENT, transition table qm_new: qm.q<id>_verify()
--   qm_fresh_partition  BEFORE UPDATE OF attempts, partition: an event made fresh again needs a
--                       partition in [0, N)
--   qm_settled, qm_settled_delete
--                       AFTER UPDATE OF state / AFTER DELETE of an event in hand by anyone but the
--                       manager: qm.notify_settled()
--   qm_rescheduled      AFTER UPDATE OF state, fire_at, priority of an event to be fired, by anyone but the
--                       manager: qm.notify_rescheduled()
CREATE OR REPLACE FUNCTION qm.apply_queue_triggers(q qm.queues) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    t text := format('public.%I', q.name);
BEGIN
    -- The rule for UPDATEs that make an event fresh again (attempts back to 0, as qm events retry
    -- does): its partition must be one of [0, N). After a shrink, an event beyond N would sit in
    -- a partition no manager scans. A BEFORE UPDATE OF attempts, partition row trigger with the
    -- rule as WHEN clause, not a CHECK constraint: PostgreSQL prepares a CHECK for every INSERT
    -- statement too (about 4 us of a single-row insert), while this one is prepared only by
    -- UPDATEs that set one of the two columns. Rows with attempts > 0 are exempt, so draining a
    -- shrinking queue never trips it. The error carries the rule's name as constraint name, as
    -- the verify trigger does for a partition outside the shuffle set.
    EXECUTE format('DROP TRIGGER IF EXISTS qm_fresh_partition ON %s', t);
    EXECUTE format('CREATE TRIGGER qm_fresh_partition BEFORE UPDATE OF attempts, partition ON %1$s FOR EACH ROW '
                   'WHEN (NEW.attempts <= 0 AND NOT (NEW.partition >= 0 AND NEW.partition < %2$s)) '
                   'EXECUTE FUNCTION qm.refuse_fresh_partition(%3$L, %2$s)', t, q.partitions, q.name);

    -- An event in hand (fired) that anyone but the manager settles (an ack by SQL in an
    -- application transaction, a delete): the manager hears of it at commit, frees the receiver's
    -- credit slot and counts the event as done. The manager's own sessions run with qm.role =
    -- manager and are left out; the WHEN clause costs its UPDATEs one comparison per row.
    EXECUTE format('DROP TRIGGER IF EXISTS qm_settled ON %s', t);
    EXECUTE format('CREATE TRIGGER qm_settled AFTER UPDATE OF state ON %s FOR EACH ROW '
                   'WHEN (OLD.state = ''fired'' AND NEW.state <> ''fired'' '
                   'AND current_setting(''qm.role'', true) IS DISTINCT FROM ''manager'') '
                   'EXECUTE FUNCTION qm.notify_settled()', t);
    EXECUTE format('DROP TRIGGER IF EXISTS qm_settled_delete ON %s', t);
    EXECUTE format('CREATE TRIGGER qm_settled_delete AFTER DELETE ON %s FOR EACH ROW '
                   'WHEN (OLD.state = ''fired'' AND current_setting(''qm.role'', true) IS DISTINCT FROM ''manager'') '
                   'EXECUTE FUNCTION qm.notify_settled()', t);

    -- An event an application makes due again or reschedules (qm events retry, an UPDATE of
    -- fire_at or priority) is announced like an insert: the manager's picks start after what it has
    -- fired, in each level; an event moved to another level may lie below that level's floor.
    EXECUTE format('DROP TRIGGER IF EXISTS qm_rescheduled ON %s', t);
    EXECUTE format('CREATE TRIGGER qm_rescheduled AFTER UPDATE OF state, fire_at, priority ON %s FOR EACH ROW '
                   'WHEN (NEW.state = ''to_be_fired'' AND current_setting(''qm.role'', true) IS DISTINCT FROM ''manager'') '
                   'EXECUTE FUNCTION qm.notify_rescheduled()', t);

    EXECUTE format('DROP TRIGGER IF EXISTS qm_route ON %s', t);
    EXECUTE format('CREATE TRIGGER qm_route BEFORE INSERT ON %s FOR EACH ROW WHEN (NEW.partition IS NULL) '
                   'EXECUTE FUNCTION qm.%I()', t, format('q%s_route', q.id));
    EXECUTE format('DROP TRIGGER IF EXISTS qm_verify ON %s', t);
    EXECUTE format('CREATE TRIGGER qm_verify AFTER INSERT ON %s REFERENCING NEW TABLE AS qm_new '
                   'FOR EACH STATEMENT EXECUTE FUNCTION qm.%I()', t, format('q%s_verify', q.id));
END
$$;
