-- Drop one tenant's overrides of a queue on this shard; true when there were some.
CREATE OR REPLACE FUNCTION qm.unset_tenant(queue_name text, tenant_name text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    qid integer;
BEGIN
    qid := (qm.queue_named(queue_name)).id;
    DELETE FROM qm.tenant_settings WHERE queue_id = qid AND tenant = tenant_name;
    RETURN FOUND;
END
$$;
