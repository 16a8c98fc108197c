-- Refuse one row that breaks a rule, with a precise message. Only the slow path calls it: the
-- generated triggers (qm.route_source, qm.verify_source) test every rule at once and call this
-- function only for a row that fails, so it re-reads the queue's settings from the registry and
-- raises for the first rule broken. Each rule has a name, <queue>_<rule>, given as the error's
-- constraint name and quoted in the message, so that clients and queue_manager.db.errors.translate
-- can tell the rules apart.
--   routed: true for a row that came through the routing trigger (partition left NULL); false
--           for a row whose partition the client set (bulk loaders). Such a row is also checked
--           against its tenant's shuffle set, and any fault is reported as a check violation
--           (23514), as CHECK constraints would report it.
CREATE OR REPLACE FUNCTION qm.refuse_event(queue_id integer, tenant text, part integer, fire_at timestamptz, fresh boolean,
                                payload_bytes integer, routed boolean) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
    s qm.shard;
    kid text := qm.keyspace_hex(tenant);
    right_shard text;
    shuffle_set smallint[];
BEGIN
    SELECT * INTO STRICT q FROM qm.queues WHERE id = queue_id;
    SELECT * INTO s FROM qm.shard;
    IF fresh IS NOT TRUE THEN
        RAISE EXCEPTION 'queue "%": new events must start as to_be_fired with attempts 0 (leave state, attempts, fired_at, acked_at and ack_deadline to their defaults; rule %_fresh_event)',
            q.name, q.name
            USING ERRCODE = '23514', CONSTRAINT = q.name || '_fresh_event',
                  HINT = 'INSERT INTO <queue> (tenant, payload[, fire_at, dedup_key]) VALUES (...)';
    END IF;
    IF tenant IS NULL OR tenant = '' THEN
        RAISE EXCEPTION 'queue "%": tenant must be a non-empty string, got % (rule %_tenant_not_empty)', q.name,
            CASE WHEN tenant IS NULL THEN 'NULL' ELSE 'an empty string' END, q.name
            USING ERRCODE = '23514', CONSTRAINT = q.name || '_tenant_not_empty';
    END IF;
    IF fire_at IS NULL THEN
        RAISE EXCEPTION 'queue "%": fire_at must not be NULL (omit the column to fire as soon as possible; rule %_fire_at_in_range)',
            q.name, q.name
            USING ERRCODE = '23514', CONSTRAINT = q.name || '_fire_at_in_range';
    END IF;
    IF payload_bytes IS NULL THEN
        RAISE EXCEPTION 'queue "%": payload must not be NULL (use ''{}'' or ''null''::jsonb for an empty payload)', q.name
            USING ERRCODE = '23514';
    END IF;
    IF s.name IS NULL THEN
        RAISE EXCEPTION 'this database has no shard identity yet' USING ERRCODE = '55000',
            HINT = 'run: qm migrate --topology <file>';
    END IF;
    IF (s.range_start <> '' AND kid COLLATE "C" < s.range_start) OR (s.range_end <> '' AND kid COLLATE "C" >= s.range_end) THEN
        right_shard := qm.shard_for(tenant);
        RAISE EXCEPTION 'tenant % belongs to shard "%", not to this shard "%" (keyspace id %; rule %_tenant_on_this_shard)',
            quote_literal(tenant), coalesce(right_shard, '<unknown: topology not stored>'), s.name, kid, q.name
            USING ERRCODE = '23514', CONSTRAINT = q.name || '_tenant_on_this_shard',
                  HINT = 'route by keyspace id (queue_manager.Router does this)',
                  DETAIL = 'right_shard=' || coalesce(right_shard, '');
    END IF;
    IF NOT routed THEN
        shuffle_set := qm.shuffle_set(tenant, q.partitions, q.shuffle);
        IF part IS NULL OR NOT part = ANY (shuffle_set) THEN
            RAISE EXCEPTION 'queue "%": partition % is not in the shuffle set of tenant % (partitions % of %; rule %_partition_in_shuffle_set)',
                q.name, part, quote_literal(tenant), array_to_string(shuffle_set, ', '), q.partitions, q.name
                USING ERRCODE = '23514', CONSTRAINT = q.name || '_partition_in_shuffle_set';
        END IF;
    END IF;
    IF payload_bytes > q.payload_limit_bytes THEN
        RAISE EXCEPTION 'queue "%": payload of % bytes exceeds the queue''s limit of % bytes (rule %_payload_within_limit)',
            q.name, payload_bytes, q.payload_limit_bytes, q.name
            USING ERRCODE = CASE WHEN routed THEN '54000' ELSE '23514' END, CONSTRAINT = q.name || '_payload_within_limit';
    END IF;
    IF fire_at < timestamptz '2000-01-01' OR fire_at > now() + make_interval(secs => q.max_delay_seconds) THEN
        RAISE EXCEPTION 'queue "%": fire_at % is out of range: it must be finite, after 2000-01-01 and at most % seconds from now (rule %_fire_at_in_range)',
            q.name, fire_at, q.max_delay_seconds, q.name
            USING ERRCODE = CASE WHEN routed THEN '22008' ELSE '23514' END, CONSTRAINT = q.name || '_fire_at_in_range';
    END IF;
    RAISE EXCEPTION 'queue "%": the generated checks refused a row but no rule names the fault (tenant %, partition %)',
        q.name, quote_literal(tenant), part
        USING ERRCODE = 'XX000', HINT = format('SELECT qm.apply_queue(%s) regenerates the checks', q.id);
END
$$;
