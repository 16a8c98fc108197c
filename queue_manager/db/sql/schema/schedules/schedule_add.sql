-- Add a periodic schedule on this shard (the one that owns the tenant), in the caller's
-- transaction: it exists, and its slots are enqueued, only once that commits. Exactly one of
-- cron (5 fields, in timezone) and interval_seconds (at least 1; slots at anchor + k * interval,
-- the first at anchor, default now). misfire: what the leader does with slots missed while
-- nothing led the shard (skip, latest: the latest once, catch_up: the last catch_up of them).
-- priority: NULL for the queue's default. A name that exists is refused (23505): see
-- qm.schedule_upsert. Checks and errors: qm.schedule_write.
CREATE OR REPLACE FUNCTION qm.schedule_add(
    name text, queue_name text, tenant text, payload jsonb DEFAULT '{}', cron text DEFAULT NULL,
    interval_seconds double precision DEFAULT NULL, timezone text DEFAULT 'UTC', misfire text DEFAULT 'latest',
    catch_up integer DEFAULT 1, priority smallint DEFAULT NULL, paused boolean DEFAULT false,
    anchor timestamptz DEFAULT NULL
) RETURNS qm.schedules
LANGUAGE sql AS $$
    SELECT qm.schedule_write(false, name, queue_name, tenant, payload, cron, interval_seconds, timezone, misfire,
                             catch_up, priority, paused, anchor);
$$;
