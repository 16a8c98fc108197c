-- Delete a schedule's slot events that are enqueued and not yet due (a pause, a change, a removal):
-- they were enqueued ahead of time and never reached a receiver. Found by the schedule's dedup key
-- prefix among its tenant's keyed events (the <queue>_dedup index) and their slots' range
-- (from now to next_at, the first slot not enqueued). Deleted events are counted done in their
-- partitions' load (qm.add_done), as a cancel's are. Returns how many went.
CREATE OR REPLACE FUNCTION qm.schedule_drop_pending(s qm.schedules) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    qname text;
    parts smallint[];
BEGIN
    SELECT q.name INTO qname FROM qm.queues q WHERE q.id = s.queue_id;
    IF qname IS NULL THEN
        RETURN 0;
    END IF;
    EXECUTE format('WITH gone AS (DELETE FROM public.%I e WHERE e.tenant = $1 AND e.dedup_key LIKE $2 '
                   'AND e.state = ''to_be_fired'' AND e.fire_at > now() AND e.fire_at < $3 RETURNING e.partition) '
                   'SELECT array_agg(partition) FROM gone', qname)
        INTO parts USING s.tenant, 'qm:schedule:' || s.id || ':%', s.next_at;
    IF parts IS NULL THEN
        RETURN 0;
    END IF;
    PERFORM qm.add_done(s.queue_id, parts);
    RETURN cardinality(parts);
END
$$;
