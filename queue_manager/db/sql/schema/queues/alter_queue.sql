-- Change a queue's settings. Growing N takes effect at once. Shrinking N stops new writes to the
-- dropped partitions at once and completes (partitions_physical = N) only when they are empty:
-- see qm.finish_resize.
CREATE OR REPLACE FUNCTION qm.alter_queue(queue_name text, settings jsonb) RETURNS qm.queues
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
BEGIN
    SELECT * INTO q FROM qm.queues WHERE name = queue_name FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" does not exist on this shard', queue_name USING ERRCODE = '42P01';
    END IF;
    PERFORM qm.write_settings(q.id, settings);
    PERFORM qm.apply_queue(q.id);
    PERFORM qm.finish_resize(queue_name);
    SELECT * INTO q FROM qm.queues WHERE id = q.id;
    RETURN q;
END
$$;
