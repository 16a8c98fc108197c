-- The schedule of that name on this shard, its row locked for the caller's change (qm.schedule_pause,
-- qm.schedule_resume); an unknown name is refused (42704).
CREATE OR REPLACE FUNCTION qm.schedule_locked(name text) RETURNS qm.schedules
LANGUAGE plpgsql AS $$
#variable_conflict use_variable
DECLARE
    r qm.schedules;
BEGIN
    SELECT * INTO r FROM qm.schedules s WHERE s.name = name FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no schedule named % on this shard', quote_literal(name) USING ERRCODE = '42704';
    END IF;
    RETURN r;
END
$$;
