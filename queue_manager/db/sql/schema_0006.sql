-- Revision 0006: bulk loads from Spark, all-or-nothing per shard and safe to re-run.
--
--   qm.spark_staging   UNLOGGED: the rows of a run as Spark's JDBC tasks write them (each task
--                      commits on its own). No unique key: a retried or speculative task may write
--                      its rows twice; the publish keeps one row per (run, queue, row_key).
--   qm.spark_runs      the run ledger, one row per (run, queue) on each shard: staged, then
--                      published (or prepared, in a two-phase run), with the row counts.
--   qm.spark_decisions on the coordinating shard of a two-phase run: written after every shard
--                      prepared and before any commits; recovery commits the prepared parts of a
--                      run that has one and rolls back the others.
--   qm.publish_run()   the publish: one INSERT ... SELECT into the queue table (its verify trigger
--                      checks every row and sends one wake-up), the load counters, the ledger, and
--                      the staging rows deleted, all in the caller's transaction.

CREATE UNLOGGED TABLE qm.spark_staging (
    run_id     text NOT NULL,
    queue      text NOT NULL,
    row_key    bigint NOT NULL,
    tenant     text,
    partition  smallint,
    payload    jsonb,
    fire_at    timestamptz,
    dedup_key  text
) WITH (autovacuum_enabled = off);
CREATE INDEX spark_staging_run ON qm.spark_staging (run_id, queue);

CREATE TABLE qm.spark_runs (
    run_id       text NOT NULL,
    queue        text NOT NULL,
    state        text NOT NULL CHECK (state IN ('staged', 'published', 'prepared')),
    staged_rows  bigint,
    published    bigint,
    started_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (run_id, queue)
);

CREATE TABLE qm.spark_decisions (
    run_id      text NOT NULL,
    queue       text NOT NULL,
    shards      text[] NOT NULL,
    decided_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (run_id, queue)
);

-- Publish the staged rows of (run, queue) into the queue table, once. Returns the number of events
-- inserted, or NULL when the run was already published (or prepared) on this shard. Rows whose
-- (tenant, dedup_key) already exist are skipped, as for any producer. Any refused row (the verify
-- trigger's checks) fails the whole statement, so a shard gets all of a run's valid rows or none.
CREATE FUNCTION qm.publish_run(run text, queue_name text, final_state text DEFAULT 'published') RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
    r qm.spark_runs;
    n bigint;
    parts integer[];
    counts integer[];
BEGIN
    IF final_state NOT IN ('published', 'prepared') THEN
        RAISE EXCEPTION 'qm.publish_run: final_state must be published or prepared, got %', final_state
            USING ERRCODE = '22023';
    END IF;
    SELECT * INTO q FROM qm.queues WHERE name = queue_name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" does not exist on this shard', queue_name USING ERRCODE = '42P01';
    END IF;
    SELECT * INTO r FROM qm.spark_runs WHERE run_id = run AND queue = queue_name FOR UPDATE;
    IF FOUND AND r.state IN ('published', 'prepared') THEN
        RETURN NULL;
    END IF;
    EXECUTE format($q$
        WITH rows AS (
            SELECT DISTINCT ON (s.row_key) s.tenant, s.partition, s.payload, s.fire_at, s.dedup_key
              FROM qm.spark_staging s
             WHERE s.run_id = $1 AND s.queue = $2
             ORDER BY s.row_key),
        ins AS (
            INSERT INTO public.%I AS t (tenant, partition, payload, fire_at, dedup_key)
            SELECT tenant, partition, payload, coalesce(fire_at, clock_timestamp()), dedup_key FROM rows
            ON CONFLICT (tenant, dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING
            RETURNING t.partition)
        SELECT coalesce(sum(c), 0), array_agg(partition ORDER BY partition), array_agg(c ORDER BY partition)
          FROM (SELECT partition, count(*)::integer AS c FROM ins GROUP BY partition) g$q$, queue_name)
      INTO n, parts, counts USING run, queue_name;
    IF n > 0 THEN
        PERFORM qm.add_load(queue_name, parts, counts);
    END IF;
    INSERT INTO qm.spark_runs (run_id, queue, state, published)
    VALUES (run, queue_name, final_state, n)
    ON CONFLICT (run_id, queue) DO UPDATE SET state = excluded.state, published = excluded.published,
                                             updated_at = clock_timestamp();
    DELETE FROM qm.spark_staging WHERE run_id = run AND queue = queue_name;
    RETURN n;
END
$$;
