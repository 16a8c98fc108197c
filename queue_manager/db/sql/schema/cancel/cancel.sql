-- Cancel events of a queue on this shard, in the caller's transaction: each of `ids` that is
-- to_be_fired or fired becomes cancelled (terminal: never fired again; acked_at holds the moment,
-- last_error the reason), and is kept for the queue's retention like an acked event. Events in
-- another state are left as they are. A to_be_fired event is counted done in its partition's load
-- here; a fired one is announced by the queue's qm_settled trigger at commit, and the manager then
-- counts it done, frees its receiver's slot and sends that connection a cancel frame
-- (docs/protocol.md, "cancel"). Returns the ids cancelled. Unknown queue: 42P01.
CREATE OR REPLACE FUNCTION qm.cancel(queue_name text, ids bigint[], reason text DEFAULT NULL) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
    why text := left(coalesce(nullif(reason, ''), 'cancelled'), 4096);
    waiting bigint[];
    waiting_parts smallint[];
    held bigint[];
BEGIN
    q := qm.queue_named(queue_name);
    IF ids IS NULL OR cardinality(ids) = 0 THEN
        RETURN ARRAY[]::bigint[];
    END IF;
    -- not fired yet; an event the manager fires meanwhile is re-checked by the UPDATE and left to
    -- the next statement
    EXECUTE format('WITH c AS (UPDATE public.%I SET state = ''cancelled'', acked_at = now(), ack_deadline = NULL, '
                   'last_error = $2 WHERE id = ANY($1) AND state = ''to_be_fired'' RETURNING id, partition) '
                   'SELECT array_agg(id), array_agg(partition) FROM c', q.name)
        INTO waiting, waiting_parts USING ids, why;
    IF waiting_parts IS NOT NULL THEN
        PERFORM qm.add_done(q.id, waiting_parts);
    END IF;
    -- in a receiver's hands
    EXECUTE format('WITH c AS (UPDATE public.%I SET state = ''cancelled'', acked_at = now(), ack_deadline = NULL, '
                   'last_error = $2 WHERE id = ANY($1) AND state = ''fired'' RETURNING id) SELECT array_agg(id) FROM c',
                   q.name)
        INTO held USING ids, why;
    RETURN coalesce(waiting, ARRAY[]::bigint[]) || coalesce(held, ARRAY[]::bigint[]);
END
$$;
