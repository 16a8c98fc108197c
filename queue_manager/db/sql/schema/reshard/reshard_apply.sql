-- Apply a batch of a reshard's copy to this (receiving) shard: the current rows of events of the
-- queue queue_name read from the shard origin (upserts: to_jsonb of each row, plus home and
-- home_id: where the origin's own map says the event came from), and the events gone from it
-- (gone: {id, home, home_id}); home_id counts only when home is this shard (an event coming back
-- after a reverse). Idempotent, in any order: each upsert writes the whole row. An event keeps its
-- id when that id is free here and is renumbered from the table's sequence otherwise (a merge: two
-- sources number their events alike); qm.reshard_rows remembers which. The sequence is first moved
-- above every id of the batch, so a renumbered event never takes an id the batch keeps. A row here
-- with the same (tenant, dedup_key) but another id is an event the origin no longer has (the key
-- is unique there too), so it goes. Set-based: a few statements per batch, whatever its size.
-- Writes with session_replication_role = replica: the queue's triggers (routing, checks, notices,
-- capture) do not fire for a copy. Returns the rows written or deleted.
CREATE OR REPLACE FUNCTION qm.reshard_apply(queue_name text, origin text, upserts jsonb, gone jsonb) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    t text;
    seq text;
    me text := (SELECT s.name FROM qm.shard s);
    top bigint;
    n integer;
    m integer;
BEGIN
    PERFORM qm.queue_named(queue_name);
    t := format('public.%I', queue_name);
    seq := pg_get_serial_sequence(t, 'id');
    PERFORM set_config('session_replication_role', 'replica', true);
    -- the events gone at the origin
    EXECUTE format(
        'DELETE FROM %s e USING (
             SELECT coalesce(CASE WHEN g->>''home'' = $3 THEN (g->>''home_id'')::bigint END, m.local_id) AS lid
               FROM jsonb_array_elements($1) g
               LEFT JOIN qm.reshard_rows m ON m.queue = $2 AND m.origin = $4 AND m.origin_id = (g->>''id'')::bigint) d
          WHERE e.id = d.lid', t)
      USING coalesce(gone, '[]'), queue_name, me, origin;
    GET DIAGNOSTICS n = ROW_COUNT;
    -- the sequence above every id of the batch, then a local id for each event seen for the first time
    SELECT max((r->>'id')::bigint) INTO top FROM jsonb_array_elements(coalesce(upserts, '[]')) r;
    IF top IS NOT NULL THEN
        EXECUTE format('SELECT setval(%L, greatest(last_value, $1)) FROM %s', seq, seq::regclass) USING top;
    END IF;
    EXECUTE format(
        'INSERT INTO qm.reshard_rows (queue, origin, origin_id, local_id)
         SELECT $2, $4, u.src_id,
                CASE WHEN NOT EXISTS (SELECT FROM %1$s e WHERE e.id = u.src_id)
                      AND NOT EXISTS (SELECT FROM qm.reshard_rows x WHERE x.queue = $2 AND x.local_id = u.src_id)
                     THEN u.src_id ELSE nextval(%2$L) END
           FROM (SELECT (r->>''id'')::bigint AS src_id FROM jsonb_array_elements($1) r
                  WHERE (r->>''home'') IS DISTINCT FROM $3) u
          WHERE NOT EXISTS (SELECT FROM qm.reshard_rows m WHERE m.queue = $2 AND m.origin = $4 AND m.origin_id = u.src_id)',
        t, seq)
      USING coalesce(upserts, '[]'), queue_name, me, origin;
    -- each upsert with its local id: twins by dedup key go (a statement of their own: the unique
    -- dedup index checks the insert below against them), then the rows are written whole
    EXECUTE format(
        'DELETE FROM %1$s e USING (
             SELECT coalesce(CASE WHEN r->>''home'' = $3 THEN (r->>''home_id'')::bigint END, m.local_id) AS lid, r
               FROM jsonb_array_elements($1) r
               LEFT JOIN qm.reshard_rows m ON m.queue = $2 AND m.origin = $4 AND m.origin_id = (r->>''id'')::bigint) b
          WHERE b.r->>''dedup_key'' IS NOT NULL AND e.tenant = b.r->>''tenant''
            AND e.dedup_key = b.r->>''dedup_key'' AND e.id <> b.lid', t)
      USING coalesce(upserts, '[]'), queue_name, me, origin;
    -- (the record is built in FROM, once per row: (f(x)).* in the select list would call f once
    -- per column, measured at 0.6 s for 951 rows instead of 0.03 s)
    EXECUTE format(
        'INSERT INTO %1$s
         SELECT p.*
           FROM (SELECT coalesce(CASE WHEN r->>''home'' = $3 THEN (r->>''home_id'')::bigint END, m.local_id) AS lid, r
                   FROM jsonb_array_elements($1) r
                   LEFT JOIN qm.reshard_rows m ON m.queue = $2 AND m.origin = $4 AND m.origin_id = (r->>''id'')::bigint) b
          CROSS JOIN LATERAL jsonb_populate_record(NULL::%1$s, (b.r - ''home'' - ''home_id'') || jsonb_build_object(''id'', b.lid)) p
         ON CONFLICT (id) DO UPDATE SET tenant = excluded.tenant, partition = excluded.partition,
             fire_at = excluded.fire_at, state = excluded.state, attempts = excluded.attempts,
             payload = excluded.payload, dedup_key = excluded.dedup_key, created_at = excluded.created_at,
             fired_at = excluded.fired_at, acked_at = excluded.acked_at, ack_deadline = excluded.ack_deadline,
             fired_term = excluded.fired_term, last_error = excluded.last_error,
             traceparent = excluded.traceparent, tracestate = excluded.tracestate, baggage = excluded.baggage,
             priority = excluded.priority, concurrency_key = excluded.concurrency_key, rate_key = excluded.rate_key', t)
      USING coalesce(upserts, '[]'), queue_name, me, origin;
    GET DIAGNOSTICS m = ROW_COUNT;
    RETURN n + m;
END
$$;
