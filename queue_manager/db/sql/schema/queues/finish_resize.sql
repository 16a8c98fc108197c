-- Complete a pending shrink when the dropped partitions hold no live event. Returns the number
-- of live events still in partitions >= N (0 when nothing is pending or the shrink completed).
CREATE OR REPLACE FUNCTION qm.finish_resize(queue_name text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
    remaining bigint;
BEGIN
    q := qm.queue_named(queue_name);
    IF q.partitions_physical = q.partitions THEN
        RETURN 0;
    END IF;
    EXECUTE format('SELECT count(*) FROM public.%I WHERE partition >= $1 AND state IN (''to_be_fired'', ''fired'')', q.name)
        INTO remaining USING q.partitions;
    IF remaining = 0 THEN
        UPDATE qm.queues SET partitions_physical = partitions, updated_at = now() WHERE id = q.id;
        PERFORM qm.apply_queue(q.id);
    END IF;
    RETURN remaining;
END
$$;
