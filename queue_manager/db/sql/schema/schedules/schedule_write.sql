-- Add a schedule, or (replace) change the one of that name: the checks of qm.schedule_add and
-- qm.schedule_upsert, each refusal with its own message and SQLSTATE, nothing changed on any.
-- What SQL cannot check is the cron expression's fields beyond their shape (5 fields of digits,
-- names, * / , -): the CLI and the admin API parse it with APScheduler first, and the leader
-- records an expression it cannot parse in qm.schedules.error (and enqueues nothing for it).
-- A change of an existing schedule drops its slot events not yet due (their dedup keys free) and
-- starts again from now with the new definition.
CREATE OR REPLACE FUNCTION qm.schedule_write(
    replace boolean, name text, queue_name text, tenant text, payload jsonb, cron text,
    interval_seconds double precision, timezone text, misfire text, catch_up integer, priority smallint,
    paused boolean, anchor timestamptz
) RETURNS qm.schedules
LANGUAGE plpgsql AS $$
#variable_conflict use_variable
DECLARE
    q qm.queues;
    sh qm.shard;
    kid text;
    old qm.schedules;
    r qm.schedules;
BEGIN
    IF name IS NULL OR name !~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}$' THEN
        RAISE EXCEPTION 'schedule name % is not valid: 1 to 100 characters, letters, digits and _ . : - (not first)',
            coalesce(quote_literal(name), 'NULL') USING ERRCODE = '22023';
    END IF;
    SELECT * INTO q FROM qm.queues WHERE qm.queues.name = queue_name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" does not exist', queue_name USING ERRCODE = '42P01';
    END IF;
    IF tenant IS NULL OR tenant = '' OR length(tenant) > 1000 THEN
        RAISE EXCEPTION 'schedule "%": tenant must be a non-empty string of at most 1000 characters', name
            USING ERRCODE = '22023';
    END IF;
    SELECT * INTO sh FROM qm.shard;
    IF sh.name IS NULL THEN
        RAISE EXCEPTION 'this database has no shard identity yet' USING ERRCODE = '55000',
            HINT = 'run: qm migrate --topology <file>';
    END IF;
    kid := qm.keyspace_hex(tenant);
    IF (sh.range_start <> '' AND kid COLLATE "C" < sh.range_start) OR (sh.range_end <> '' AND kid COLLATE "C" >= sh.range_end) THEN
        RAISE EXCEPTION 'schedule "%": tenant % belongs to shard "%", not to this shard "%": add the schedule there',
            name, quote_literal(tenant), coalesce(qm.shard_for(tenant), '<unknown: topology not stored>'), sh.name
            USING ERRCODE = '23514', DETAIL = 'right_shard=' || coalesce(qm.shard_for(tenant), '');
    END IF;
    IF (cron IS NULL) = (interval_seconds IS NULL) THEN
        RAISE EXCEPTION 'schedule "%": give either a cron expression or an interval, not %', name,
            CASE WHEN cron IS NULL THEN 'neither' ELSE 'both' END USING ERRCODE = '22023';
    END IF;
    IF cron IS NOT NULL AND (length(cron) > 200
            OR array_length(regexp_split_to_array(btrim(cron), '\s+'), 1) <> 5
            OR btrim(cron) !~ '^[0-9A-Za-z*/,?-]+(\s+[0-9A-Za-z*/,?-]+){4}$') THEN
        RAISE EXCEPTION 'schedule "%": cron expression % is not valid: 5 fields (minute hour day month weekday), e.g. ''0 3 * * *''',
            name, quote_literal(left(cron, 60)) USING ERRCODE = '22023';
    END IF;
    IF interval_seconds IS NOT NULL AND NOT (interval_seconds >= 1 AND interval_seconds <= 31622400) THEN
        RAISE EXCEPTION 'schedule "%": the interval must be from 1 second to 366 days, got % s', name, interval_seconds
            USING ERRCODE = '22023';
    END IF;
    -- pg_timezone_names reads every zone file (about 30 ms): asked only for a zone no schedule has yet
    IF timezone IS NULL OR (timezone <> 'UTC' AND NOT EXISTS (SELECT 1 FROM qm.schedules z WHERE z.timezone = timezone)
                            AND NOT EXISTS (SELECT 1 FROM pg_timezone_names z WHERE z.name = timezone)) THEN
        RAISE EXCEPTION 'schedule "%": unknown time zone %; use an IANA name such as UTC or Europe/Berlin', name,
            coalesce(quote_literal(left(timezone, 64)), 'NULL') USING ERRCODE = '22023';
    END IF;
    IF misfire IS NULL OR misfire NOT IN ('skip', 'latest', 'catch_up') THEN
        RAISE EXCEPTION 'schedule "%": misfire must be skip, latest or catch_up, got %', name,
            coalesce(quote_literal(misfire), 'NULL') USING ERRCODE = '22023';
    END IF;
    IF catch_up IS NULL OR catch_up < 1 OR catch_up > 1000 THEN
        RAISE EXCEPTION 'schedule "%": catch_up must be from 1 to 1000, got %', name, coalesce(catch_up::text, 'NULL')
            USING ERRCODE = '22023';
    END IF;
    IF priority IS NOT NULL AND priority NOT BETWEEN 1 AND 5 THEN
        RAISE EXCEPTION 'schedule "%": priority must be from 1 (highest) to 5, got %', name, priority
            USING ERRCODE = '22023';
    END IF;
    IF payload IS NULL THEN
        RAISE EXCEPTION 'schedule "%": payload must not be NULL (use ''{}'')', name USING ERRCODE = '22023';
    END IF;
    IF pg_column_size(payload) > q.payload_limit_bytes THEN
        RAISE EXCEPTION 'schedule "%": the payload (% bytes) is over queue "%"''s payload_limit_bytes (%)', name,
            pg_column_size(payload), q.name, q.payload_limit_bytes USING ERRCODE = '54000';
    END IF;
    SELECT * INTO old FROM qm.schedules s WHERE s.name = name FOR UPDATE;
    IF FOUND AND NOT replace THEN
        RAISE EXCEPTION 'a schedule named "%" exists already on this shard (queue %, tenant %); change it with qm.schedule_upsert or remove it first',
            name, (SELECT q2.name FROM qm.queues q2 WHERE q2.id = old.queue_id), quote_literal(old.tenant)
            USING ERRCODE = '23505';
    END IF;
    IF FOUND THEN
        PERFORM qm.schedule_drop_pending(old);
        UPDATE qm.schedules s
           SET queue_id = q.id, tenant = tenant, payload = payload, cron = btrim(cron),
               interval_seconds = interval_seconds, timezone = timezone, misfire = misfire, catch_up = catch_up,
               priority = priority, paused = coalesce(paused, false), anchor = coalesce(anchor, now()),
               next_at = now(), error = NULL, updated_at = now()
         WHERE s.id = old.id
        RETURNING * INTO r;
    ELSE
        INSERT INTO qm.schedules (name, queue_id, tenant, payload, cron, interval_seconds, timezone, misfire, catch_up,
                                  priority, paused, anchor)
        VALUES (name, q.id, tenant, payload, btrim(cron), interval_seconds, timezone, misfire, catch_up, priority,
                coalesce(paused, false), coalesce(anchor, now()))
        RETURNING * INTO r;
    END IF;
    RETURN r;
END
$$;
