-- The rule a fresh, well-formed row of this shard passes, as an expression over a row variable
-- (%1$s) and the md5 of its tenant (%2$s), both filled in by format(): qm.rule_fresh, a non-empty
-- tenant, a fire_at in range, a payload within the queue's limit, a well-formed trace context
-- (qm.rule_trace), a priority in range and well-formed keys (qm.rule_keys), and a keyspace id within
-- the shard's range (s: the shard's row).
CREATE OR REPLACE FUNCTION qm.rule_valid(q qm.queues, s qm.shard) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    valid text;
BEGIN
    valid := qm.rule_fresh() || format(' AND %%1$s.tenant <> '''' AND %%1$s.fire_at >= ''2000-01-01'' '
                                       'AND %%1$s.fire_at <= now() + %L::interval AND pg_column_size(%%1$s.payload) <= %s',
                                       q.max_delay_seconds || ' seconds', q.payload_limit_bytes)
             || ' AND ' || qm.rule_trace() || ' AND ' || qm.rule_keys();
    IF s.range_start <> '' THEN
        valid := valid || format(' AND %%2$s COLLATE "C" >= %L', s.range_start);
    END IF;
    IF s.range_end <> '' THEN
        valid := valid || format(' AND %%2$s COLLATE "C" < %L', s.range_end);
    END IF;
    RETURN valid;
END
$$;
