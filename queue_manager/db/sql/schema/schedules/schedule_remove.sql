-- Remove a schedule and its slot events not yet due. Its events that fired stay (with their
-- dedup keys, until retention). Returns false when no schedule has that name on this shard.
CREATE OR REPLACE FUNCTION qm.schedule_remove(name text) RETURNS boolean
LANGUAGE plpgsql AS $$
#variable_conflict use_variable
DECLARE
    r qm.schedules;
BEGIN
    DELETE FROM qm.schedules s WHERE s.name = name RETURNING * INTO r;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM qm.schedule_drop_pending(r);
    RETURN true;
END
$$;
