-- The reshard triggers of one queue's table, from the shard's state (called by qm.apply_queue and
-- by qm.set_serving / qm.set_capturing for every queue). Each is created or dropped only when it
-- must change, so an apply that changes nothing takes no lock on the table:
--   qm_moved        BEFORE INSERT OR UPDATE OR DELETE FOR EACH ROW while the shard does not serve,
--                   by anyone but the manager: qm.refuse_moved()
--   qm_capture_ins, qm_capture_upd, qm_capture_del
--                   AFTER INSERT / UPDATE / DELETE FOR EACH STATEMENT while capturing:
--                   qm.reshard_capture_rows()
-- Creating a trigger waits for the transactions writing the table: once qm_moved is committed, no
-- write of an event that it did not see is still open.
CREATE OR REPLACE FUNCTION qm.apply_reshard_triggers(q qm.queues, s qm.shard) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    t text := format('public.%I', q.name);
    moved boolean := coalesce(s.serving, 'serving') <> 'serving';
    capture boolean := coalesce(s.capturing, false);
    has_moved boolean;
    has_capture boolean;
BEGIN
    SELECT EXISTS (SELECT FROM pg_trigger WHERE tgrelid = t::regclass AND tgname = 'qm_moved'),
           EXISTS (SELECT FROM pg_trigger WHERE tgrelid = t::regclass AND tgname = 'qm_capture_ins')
      INTO has_moved, has_capture;
    IF moved AND NOT has_moved THEN
        EXECUTE format('CREATE TRIGGER qm_moved BEFORE INSERT OR UPDATE OR DELETE ON %s FOR EACH ROW '
                       'WHEN (current_setting(''qm.role'', true) IS DISTINCT FROM ''manager'') '
                       'EXECUTE FUNCTION qm.refuse_moved()', t);
    ELSIF has_moved AND NOT moved THEN
        EXECUTE format('DROP TRIGGER qm_moved ON %s', t);
    END IF;
    IF capture AND NOT has_capture THEN
        EXECUTE format('CREATE TRIGGER qm_capture_ins AFTER INSERT ON %s REFERENCING NEW TABLE AS qm_new '
                       'FOR EACH STATEMENT EXECUTE FUNCTION qm.reshard_capture_rows()', t);
        EXECUTE format('CREATE TRIGGER qm_capture_upd AFTER UPDATE ON %s REFERENCING NEW TABLE AS qm_new '
                       'FOR EACH STATEMENT EXECUTE FUNCTION qm.reshard_capture_rows()', t);
        EXECUTE format('CREATE TRIGGER qm_capture_del AFTER DELETE ON %s REFERENCING OLD TABLE AS qm_old '
                       'FOR EACH STATEMENT EXECUTE FUNCTION qm.reshard_capture_rows()', t);
    ELSIF has_capture AND NOT capture THEN
        EXECUTE format('DROP TRIGGER qm_capture_ins ON %s', t);
        EXECUTE format('DROP TRIGGER IF EXISTS qm_capture_upd ON %s', t);
        EXECUTE format('DROP TRIGGER IF EXISTS qm_capture_del ON %s', t);
    END IF;
END
$$;
