-- Revision 0004_archive_ledger: where the Spark archive job (spark_jobs/archive.py,
-- docs/spark-archive.md) leaves a trace in each shard, for `qm web`'s health page and for an
-- operator with psql. One row per run on this shard: its latest step and the rows of each. The
-- run's truth stays in its output directory (plan, manifests, deletion records); this ledger is
-- written after each step, and a failed write is logged without stopping the run.
CREATE TABLE qm.archive_runs (
    run_id      text PRIMARY KEY,
    -- the latest step on this shard: planned, read, written, verified, committed, delete_slice,
    -- deleted (finished) or finished_before (a re-run found it finished)
    stage       text NOT NULL,
    -- candidates counted at the plan; rows committed to Parquet; rows deleted from the shard so far
    planned     bigint,
    archived    bigint,
    deleted     bigint NOT NULL DEFAULT 0,
    -- the step's detail (the cut-off at the plan, the committed directory, the rows kept...)
    detail      text NOT NULL DEFAULT '',
    started_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE qm.archive_runs IS 'qm: Spark archive runs on this shard, their latest step (spark_jobs/archive.py)';
