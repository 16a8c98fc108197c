-- Every job's counts on this shard: the slices of every manager of the shard together.
CREATE OR REPLACE FUNCTION qm.maintenance_counts()
RETURNS TABLE (job text, recruited bigint, finished bigint, aborted bigint, events bigint)
LANGUAGE sql AS $$
    SELECT j,
           coalesce(pg_sequence_last_value(format('qm.%I', 'maint_' || j || '_recruited')::regclass), 0),
           coalesce(pg_sequence_last_value(format('qm.%I', 'maint_' || j || '_finished')::regclass), 0),
           coalesce(pg_sequence_last_value(format('qm.%I', 'maint_' || j || '_aborted')::regclass), 0),
           coalesce(pg_sequence_last_value(format('qm.%I', 'maint_' || j || '_events')::regclass), 0)
      FROM unnest(qm.maintenance_jobs()) WITH ORDINALITY AS u(j, o)
     ORDER BY o;
$$;
