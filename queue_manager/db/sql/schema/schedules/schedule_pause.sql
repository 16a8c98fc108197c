-- Pause a schedule: no slot is enqueued while it is paused, and its slot events enqueued ahead of
-- time and not yet due are deleted in the same transaction (a slot due before the pause commits
-- has fired or fires). The slots of the pause are never enqueued (not even by the misfire
-- policy): a resume goes on from its own time. Unknown name: 42704.
CREATE OR REPLACE FUNCTION qm.schedule_pause(name text) RETURNS qm.schedules
LANGUAGE plpgsql AS $$
DECLARE
    r qm.schedules;
BEGIN
    r := qm.schedule_locked(name);
    PERFORM qm.schedule_drop_pending(r);
    UPDATE qm.schedules s SET paused = true, next_at = least(s.next_at, now()), updated_at = now()
     WHERE s.id = r.id RETURNING * INTO r;
    RETURN r;
END
$$;
