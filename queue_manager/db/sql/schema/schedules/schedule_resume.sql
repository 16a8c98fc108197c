-- Resume a paused schedule: its slots are enqueued from now on (the first slot at or after the
-- resume). Resuming one that is not paused changes nothing. Unknown name: 42704.
CREATE OR REPLACE FUNCTION qm.schedule_resume(name text) RETURNS qm.schedules
LANGUAGE plpgsql AS $$
#variable_conflict use_variable
DECLARE
    r qm.schedules;
BEGIN
    SELECT * INTO r FROM qm.schedules s WHERE s.name = name FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no schedule named % on this shard', quote_literal(name) USING ERRCODE = '42704';
    END IF;
    IF r.paused THEN
        UPDATE qm.schedules s SET paused = false, next_at = now(), updated_at = now()
         WHERE s.id = r.id RETURNING * INTO r;
    END IF;
    RETURN r;
END
$$;
