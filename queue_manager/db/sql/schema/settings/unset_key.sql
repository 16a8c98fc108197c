-- Drop the limits of one key of one tenant of a queue on this shard; true when there were some.
CREATE OR REPLACE FUNCTION qm.unset_key(queue_name text, tenant_name text, key_name text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    qid integer;
BEGIN
    qid := (qm.queue_named(queue_name)).id;
    DELETE FROM qm.key_settings WHERE queue_id = qid AND tenant = tenant_name AND key = key_name;
    RETURN FOUND;
END
$$;
