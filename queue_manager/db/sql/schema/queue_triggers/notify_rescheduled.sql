-- The qm_rescheduled trigger's function (qm.apply_queue_triggers): an application made an event
-- due (a retry of a dead letter, a reschedule): '<queue> at <fire_at or the transaction's start,
-- epoch microseconds>', delivered at commit, as a producer's notice would be; the manager's floors
-- fall to it.
CREATE OR REPLACE FUNCTION qm.notify_rescheduled() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('qm_wake', TG_TABLE_NAME || ' at '
                                 || (extract(epoch FROM least(NEW.fire_at, now())) * 1000000)::bigint);
    RETURN NULL;
END
$$;
