-- Apply a batch of a reshard's copy to this (receiving) shard: the current rows of events of the
-- queue queue_name read from the shard origin (upserts: to_jsonb of each row, plus home_id when the
-- origin's own map says the event came from shard home with id home_id), and the events gone
-- from it (gone: {id, home, home_id}); home_id counts only when home is this shard. Idempotent, in any order: each upsert writes the whole row. An event
-- keeps its id when that id is free here and is renumbered from the table's sequence otherwise
-- (a merge: two sources number their events alike); qm.reshard_rows remembers which. A row here
-- with the same (tenant, dedup_key) but another id is an event the origin no longer has (the key
-- is unique there too), so it goes. Writes with session_replication_role = replica: the queue's
-- triggers (routing, checks, notices, capture) do not fire for a copy. Returns the rows written.
CREATE OR REPLACE FUNCTION qm.reshard_apply(queue_name text, origin text, upserts jsonb, gone jsonb) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    t text;
    seq text;
    r jsonb;
    src_id bigint;
    lid bigint;
    taken boolean;
    me text := (SELECT s.name FROM qm.shard s);
    n integer := 0;
BEGIN
    IF NOT EXISTS (SELECT FROM qm.queues WHERE name = queue_name) THEN
        RAISE EXCEPTION 'queue "%" does not exist on this shard', queue_name USING ERRCODE = '42P01';
    END IF;
    t := format('public.%I', queue_name);
    seq := pg_get_serial_sequence(t, 'id');
    PERFORM set_config('session_replication_role', 'replica', true);
    FOR r IN SELECT value FROM jsonb_array_elements(coalesce(gone, '[]')) LOOP
        lid := CASE WHEN r->>'home' = me THEN (r->>'home_id')::bigint END;
        IF lid IS NULL THEN
            SELECT m.local_id INTO lid FROM qm.reshard_rows m
             WHERE m.queue = queue_name AND m.origin = reshard_apply.origin AND m.origin_id = (r->>'id')::bigint;
        END IF;
        IF lid IS NOT NULL THEN
            EXECUTE format('DELETE FROM %s WHERE id = $1', t) USING lid;
            n := n + 1;
        END IF;
    END LOOP;
    FOR r IN SELECT value FROM jsonb_array_elements(coalesce(upserts, '[]')) LOOP
        src_id := (r->>'id')::bigint;
        lid := CASE WHEN r->>'home' = me THEN (r->>'home_id')::bigint END;
        IF lid IS NULL THEN
            SELECT m.local_id INTO lid FROM qm.reshard_rows m
             WHERE m.queue = queue_name AND m.origin = reshard_apply.origin AND m.origin_id = src_id;
        END IF;
        IF lid IS NULL THEN
            lid := src_id;
            LOOP
                EXECUTE format('SELECT EXISTS (SELECT FROM %s WHERE id = $1)', t) INTO taken USING lid;
                EXIT WHEN NOT taken AND NOT EXISTS (SELECT FROM qm.reshard_rows m WHERE m.queue = queue_name AND m.local_id = lid);
                lid := nextval(seq);
            END LOOP;
            INSERT INTO qm.reshard_rows (queue, origin, origin_id, local_id) VALUES (queue_name, reshard_apply.origin, src_id, lid);
        END IF;
        IF r->>'dedup_key' IS NOT NULL THEN
            EXECUTE format('DELETE FROM %s WHERE tenant = $1 AND dedup_key = $2 AND id <> $3', t)
              USING r->>'tenant', r->>'dedup_key', lid;
        END IF;
        EXECUTE format('INSERT INTO %1$s SELECT * FROM jsonb_populate_record(NULL::%1$s, $1) '
                       'ON CONFLICT (id) DO UPDATE SET tenant = excluded.tenant, partition = excluded.partition, '
                       'fire_at = excluded.fire_at, state = excluded.state, attempts = excluded.attempts, '
                       'payload = excluded.payload, dedup_key = excluded.dedup_key, created_at = excluded.created_at, '
                       'fired_at = excluded.fired_at, acked_at = excluded.acked_at, ack_deadline = excluded.ack_deadline, '
                       'fired_term = excluded.fired_term, last_error = excluded.last_error', t)
          USING (r - 'home' - 'home_id') || jsonb_build_object('id', lid);
        n := n + 1;
    END LOOP;
    RETURN n;
END
$$;
