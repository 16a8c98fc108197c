-- Publish the good rows of a staged run into the queue table, once: one statement of two INSERT ...
-- SELECTs (the queue's verify trigger checks every row: one refused row fails the whole statement, so the shard
-- gets all of the run's good rows or none; rows whose (tenant, dedup_key) exists are skipped, as for
-- any producer), the load counters bumped by the rows inserted per partition (qm.add_load, as the
-- Python bulk producer does), the ledger marked published and the stage table dropped, all in the
-- caller's transaction. Returns the events inserted, or NULL when the run was published already.
-- two_phase: the caller will PREPARE the transaction, which PostgreSQL refuses after a NOTIFY, so
-- the verify trigger leaves its wake-up to the caller (qm.defer_wake), who sends it after COMMIT
-- PREPARED from the ledger's wake_at.
CREATE OR REPLACE FUNCTION qm.publish_run(run text, queue_name text, two_phase boolean DEFAULT false) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    r qm.spark_runs;
    source text;
    written bigint;
    n bigint;
    parts integer[];
    counts integer[];
    earliest timestamptz;
    -- the trace context columns of the stage table; NULLs for one created before they existed
    -- (staged before revision 0006_trace_context, published after)
    trace_cols text;
    -- the priority and keys; the queue's default priority and no keys for a stage table created
    -- before they existed (staged before revision 0009_priorities_keys, published after)
    key_cols text;
BEGIN
    SELECT * INTO r FROM qm.spark_runs s WHERE s.run_id = run AND s.queue = queue_name FOR UPDATE;
    IF FOUND AND r.state = 'published' THEN
        RETURN NULL;
    END IF;
    IF NOT FOUND OR r.state <> 'staged' THEN
        RAISE EXCEPTION 'Spark run % of queue "%" is not staged on this shard (state %): run the job again',
            quote_literal(run), queue_name, coalesce(r.state, 'none') USING ERRCODE = '55000';
    END IF;
    PERFORM qm.queue_named(queue_name);
    IF two_phase THEN
        PERFORM set_config('qm.defer_wake', 'on', true);
    END IF;
    -- A task attempt that Spark gave up on may still commit its rows late: SHARE mode waits for it
    -- and keeps any other writer out until this transaction ends (and drops the table).
    EXECUTE format('LOCK TABLE qm.%I IN SHARE MODE', r.stage_table);
    EXECUTE format('SELECT count(*) FROM qm.%I', r.stage_table) INTO written;
    -- one row per row key; the sort only when some row was written twice
    source := CASE WHEN written > r.good_rows + r.rejected_rows
                   THEN format('(SELECT DISTINCT ON (x.row_key) x.* FROM qm.%I x ORDER BY x.row_key)', r.stage_table)
                   ELSE format('qm.%I', r.stage_table) END;
    trace_cols := CASE WHEN EXISTS (SELECT FROM pg_attribute a
                                     WHERE a.attrelid = format('qm.%I', r.stage_table)::regclass
                                       AND a.attname = 'traceparent' AND NOT a.attisdropped)
                       THEN 's.traceparent, s.tracestate, s.baggage' ELSE 'NULL, NULL, NULL' END;
    key_cols := format(CASE WHEN EXISTS (SELECT FROM pg_attribute a
                                          WHERE a.attrelid = format('qm.%I', r.stage_table)::regclass
                                            AND a.attname = 'priority' AND NOT a.attisdropped)
                            THEN 'coalesce(s.priority, %s), s.concurrency_key, s.rate_key' ELSE '%s, NULL, NULL' END,
                       (SELECT default_priority FROM qm.queues WHERE name = queue_name));
    -- Rows without a dedup key go in by a plain INSERT, the others with ON CONFLICT: an INSERT with
    -- ON CONFLICT inserts every row speculatively (one more WAL record per row, a quarter more
    -- work), even a row its arbiter index leaves out. Two data-modifying CTEs of one statement: the
    -- verify trigger still runs once, over both (one transition table, one wake-up).
    EXECUTE format($q$
        WITH plain AS (
            INSERT INTO public.%1$I AS t (tenant, partition, payload, fire_at, dedup_key, traceparent, tracestate, baggage,
                                          priority, concurrency_key, rate_key)
            SELECT s.tenant, s.partition, s.payload::jsonb,
                   coalesce(timestamptz 'epoch' + s.fire_at_us * interval '1 microsecond', $1), NULL, %2$s, %4$s
              FROM %3$s s
             WHERE s.reason IS NULL AND s.dedup_key IS NULL
            RETURNING t.partition, t.fire_at),
        keyed AS (
            INSERT INTO public.%1$I AS t (tenant, partition, payload, fire_at, dedup_key, traceparent, tracestate, baggage,
                                          priority, concurrency_key, rate_key)
            SELECT s.tenant, s.partition, s.payload::jsonb,
                   coalesce(timestamptz 'epoch' + s.fire_at_us * interval '1 microsecond', $1), s.dedup_key, %2$s, %4$s
              FROM %3$s s
             WHERE s.reason IS NULL AND s.dedup_key IS NOT NULL
            ON CONFLICT (tenant, dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING
            RETURNING t.partition, t.fire_at),
        ins AS (SELECT * FROM plain UNION ALL SELECT * FROM keyed)
        SELECT coalesce(sum(g.c), 0), array_agg(g.partition ORDER BY g.partition), array_agg(g.c ORDER BY g.partition),
               min(g.earliest)
          FROM (SELECT i.partition, count(*)::integer AS c, min(i.fire_at) AS earliest FROM ins i GROUP BY i.partition) g
        $q$, queue_name, trace_cols, source, key_cols)
      INTO n, parts, counts, earliest USING clock_timestamp();
    IF n > 0 THEN
        PERFORM qm.add_load(queue_name, parts, counts);
    END IF;
    EXECUTE format('DROP TABLE qm.%I', r.stage_table);
    UPDATE qm.spark_runs s
       SET state = 'published', published = n, dedup_skipped = r.good_rows - n, stage_table = NULL,
           duplicate_rows = written - r.good_rows - r.rejected_rows,
           wake_at = least(earliest, now()), updated_at = clock_timestamp()
     WHERE s.run_id = run AND s.queue = queue_name;
    RETURN n;
END
$$;
