-- Add a periodic schedule, or change the one of that name (arguments as qm.schedule_add). A change
-- drops the schedule's slot events not yet due and enqueues from now on by the new definition.
CREATE OR REPLACE FUNCTION qm.schedule_upsert(
    name text, queue_name text, tenant text, payload jsonb DEFAULT '{}', cron text DEFAULT NULL,
    interval_seconds double precision DEFAULT NULL, timezone text DEFAULT 'UTC', misfire text DEFAULT 'latest',
    catch_up integer DEFAULT 1, priority smallint DEFAULT NULL, paused boolean DEFAULT false,
    anchor timestamptz DEFAULT NULL
) RETURNS qm.schedules
LANGUAGE sql AS $$
    SELECT qm.schedule_write(true, name, queue_name, tenant, payload, cron, interval_seconds, timezone, misfire,
                             catch_up, priority, paused, anchor);
$$;
