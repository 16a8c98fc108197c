-- The function of a queue's change-capture triggers during a reshard (qm_capture_ins, _upd, _del:
-- AFTER ... FOR EACH STATEMENT with the statement's rows as transition table; present while
-- qm.shard.capturing, see qm.apply_reshard_triggers): one entry (queue, id, tenant) per changed row
-- in qm.reshard_capture. Statement-level, so a COPY or a batched manager UPDATE pays one INSERT.
-- The copy itself writes with session_replication_role = replica, which fires no such trigger.
CREATE OR REPLACE FUNCTION qm.reshard_capture_rows() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        INSERT INTO qm.reshard_capture (queue, id, tenant) SELECT TG_TABLE_NAME, o.id, o.tenant FROM qm_old o;
    ELSE
        INSERT INTO qm.reshard_capture (queue, id, tenant) SELECT TG_TABLE_NAME, n.id, n.tenant FROM qm_new n;
    END IF;
    RETURN NULL;
END
$$;
