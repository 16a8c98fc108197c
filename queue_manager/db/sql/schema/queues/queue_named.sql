-- The queue of that name on this shard, for a function that acts on a queue; an unknown name is
-- refused (42P01) with the one message every such function gives.
CREATE OR REPLACE FUNCTION qm.queue_named(queue_name text) RETURNS qm.queues
LANGUAGE plpgsql STABLE AS $$
DECLARE
    q qm.queues;
BEGIN
    SELECT * INTO q FROM qm.queues WHERE name = queue_name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" does not exist on this shard', queue_name USING ERRCODE = '42P01';
    END IF;
    RETURN q;
END
$$;
