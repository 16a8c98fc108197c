-- Revision 0008_schedules_cancel: periodic schedules and the terminal state cancelled
-- (docs/design.md, "Schedules" and "Cancel").
--
-- cancelled: an event an operator cancelled (qm.cancel, qm events cancel, the dashboard), before
-- it fired or while a receiver held it. Terminal like acked: never fired again, counted, kept for
-- the queue's retention_seconds (acked_at holds the moment of the cancel) and archived like acked.
-- A value added to an enum cannot be named in the transaction that adds it (PostgreSQL: "unsafe
-- use of new value"), and a migration is one transaction: so the retention index of cancelled
-- events says state > 'failed', which is the same thing (cancelled is the enum's last value), and
-- every function that names 'cancelled' is PL/pgSQL (bound when it runs, not when it is created).
ALTER TYPE qm.event_state ADD VALUE IF NOT EXISTS 'cancelled';

DO $$
DECLARE
    q record;
BEGIN
    FOR q IN SELECT name FROM qm.queues LOOP
        EXECUTE format('CREATE INDEX IF NOT EXISTS %I ON public.%I (partition, acked_at) WHERE state > ''failed''',
                       q.name || '_cancelled', q.name);
    END LOOP;
END
$$;

-- A periodic schedule: the shard's leader enqueues an event into `queue` for `tenant` at each slot
-- of the cron expression (in `timezone`) or of the interval (anchor + k * interval_seconds), ahead
-- of time, with fire_at the slot's instant and the dedup key 'qm:schedule:<id>:<slot>'. The row
-- lives on the shard that owns the tenant (qm.schedule_add refuses another).
CREATE TABLE qm.schedules (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name             text NOT NULL UNIQUE CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}$'),
    queue_id         integer NOT NULL REFERENCES qm.queues (id) ON DELETE CASCADE,
    tenant           text NOT NULL CHECK (tenant <> '' AND length(tenant) <= 1000),
    payload          jsonb NOT NULL DEFAULT '{}',
    -- NULL: the queue's default priority
    priority         smallint CHECK (priority BETWEEN 1 AND 5),
    -- exactly one of a 5-field cron expression and an interval of at least 1 s
    cron             text CHECK (length(cron) <= 200),
    interval_seconds double precision CHECK (interval_seconds >= 1 AND interval_seconds <= 31622400),
    timezone         text NOT NULL DEFAULT 'UTC' CHECK (length(timezone) <= 64),
    -- the instant interval slots count from
    anchor           timestamptz NOT NULL DEFAULT now(),
    paused           boolean NOT NULL DEFAULT false,
    -- slots missed while nothing led the shard: skip them, enqueue the latest once, or the last catch_up
    misfire          text NOT NULL DEFAULT 'latest' CHECK (misfire IN ('skip', 'latest', 'catch_up')),
    catch_up         integer NOT NULL DEFAULT 1 CHECK (catch_up BETWEEN 1 AND 1000),
    -- slots from here on are not enqueued yet (the first slot at or after it is next), written by
    -- the leader as it enqueues; set to now() by a resume or a change
    next_at          timestamptz NOT NULL DEFAULT now(),
    -- the last slot enqueued, its event's id, and the slots the misfire policy skipped
    last_slot        timestamptz,
    last_event_id    bigint,
    missed           bigint NOT NULL DEFAULT 0,
    -- why the leader could not compute this schedule's slots (NULL: it can)
    error            text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    CHECK ((cron IS NULL) <> (interval_seconds IS NULL))
);
CREATE INDEX schedules_due ON qm.schedules (next_at) WHERE NOT paused;
COMMENT ON TABLE qm.schedules IS 'qm: periodic schedules of this shard''s tenants, enqueued by the leader slot by slot';
