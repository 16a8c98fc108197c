-- Generate a queue's counters, its triggers and their functions from its settings and the shard's
-- range; called by qm.create_queue, qm.alter_queue, qm.finish_resize, qm.set_topology, and for
-- every queue at the end of every migration (queue_manager/db/schema.py). Every setting is written
-- into the generated code as a constant, so a routed insert reads no catalog row but the counters,
-- and the checks are planned once per session. The pieces, in the order they run:
--   qm.apply_queue_counters  the queue's enqueue and done sequences, one pair per partition
--   qm.route_source          qm.q<id>_route(), the function of the BEFORE INSERT FOR EACH ROW
--                            trigger qm_route (WHEN NEW.partition IS NULL): validates the row
--                            (precise errors via qm.refuse_event) and writes the least-loaded
--                            partition of the tenant's shuffle set (qm.route_picks)
--   qm.verify_source         qm.q<id>_verify(), the function of the AFTER INSERT FOR EACH STATEMENT
--                            trigger qm_verify: checks every row the statement inserted, whatever
--                            wrote it (INSERT, multi-row INSERT, INSERT ... SELECT, COPY, JDBC), in
--                            one set-based pass, then wakes the manager if it is waiting
--   qm.apply_queue_triggers  the triggers on the queue table
--   qm.apply_reshard_triggers  the triggers of a reshard (qm_moved, the change capture), per the
--                            shard's serving and capturing state
--   qm.apply_queue_default   the priority column's default: the queue's default_priority
-- The rules both generated functions check are qm.rule_fresh, qm.rule_valid (with qm.rule_trace and
-- qm.rule_keys) and qm.rule_member.
-- Why not CHECK constraints: PostgreSQL parses and plans every CHECK expression again, from its
-- stored text, for each INSERT statement. For the shuffle-set, range and payload checks that cost
-- about 27 us per single-row INSERT; the statement trigger's plan is cached for the session.
-- Every inserted row must be a fresh event (to_be_fired, attempts 0). UPDATEs are not re-checked:
-- they are the manager's, so a later change of N, of the payload limit or of the shard range
-- never blocks draining the rows written before it.
CREATE OR REPLACE FUNCTION qm.apply_queue(queue_id integer) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
    s qm.shard;
BEGIN
    q := qm.apply_queue_counters(queue_id);
    SELECT * INTO s FROM qm.shard;
    EXECUTE qm.route_source(q, s);
    EXECUTE qm.verify_source(q, s);
    PERFORM qm.apply_queue_triggers(q);
    PERFORM qm.apply_reshard_triggers(q, s);
    PERFORM qm.apply_queue_default(q);
END
$$;
