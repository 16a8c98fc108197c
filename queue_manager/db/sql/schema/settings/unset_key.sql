-- Drop the limits of one key of one tenant of a queue on this shard; true when there were some.
CREATE OR REPLACE FUNCTION qm.unset_key(queue_name text, tenant_name text, key_name text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    qid integer;
BEGIN
    SELECT id INTO qid FROM qm.queues WHERE name = queue_name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" does not exist on this shard', queue_name USING ERRCODE = '42P01';
    END IF;
    DELETE FROM qm.key_settings WHERE queue_id = qid AND tenant = tenant_name AND key = key_name;
    RETURN FOUND;
END
$$;
