-- The qm_settled and qm_settled_delete triggers' function (qm.apply_queue_triggers): an event in
-- hand that anyone but the manager settles (an ack by SQL, a delete) is announced on qm_wake as
-- '<queue> settled <id> <attempt> <partition> <new state or deleted>', delivered when the settling
-- transaction commits (never when it rolls back).
CREATE OR REPLACE FUNCTION qm.notify_settled() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('qm_wake', TG_TABLE_NAME || ' settled ' || OLD.id || ' ' || OLD.attempts || ' ' || OLD.partition
                                 || ' ' || CASE WHEN TG_OP = 'DELETE' THEN 'deleted' ELSE NEW.state::text END);
    RETURN NULL;
END
$$;
