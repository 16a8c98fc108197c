-- Resume a paused schedule: its slots are enqueued from now on (the first slot at or after the
-- resume). Resuming one that is not paused changes nothing. Unknown name: 42704.
CREATE OR REPLACE FUNCTION qm.schedule_resume(name text) RETURNS qm.schedules
LANGUAGE plpgsql AS $$
DECLARE
    r qm.schedules;
BEGIN
    r := qm.schedule_locked(name);
    IF r.paused THEN
        UPDATE qm.schedules s SET paused = false, next_at = now(), updated_at = now()
         WHERE s.id = r.id RETURNING * INTO r;
    END IF;
    RETURN r;
END
$$;
