-- Database health readings (qm status and the manager's health gauges; docs/operations.md,
-- "Database health"). Catalog and statistics reads only: no queue table is scanned, so a reading
-- costs the same whatever the queues hold. The oldest holder of the xmin horizon is the
-- `xmin_horizon` query of queries.sql.

-- health_tables --
-- Per queue table: live and dead tuples (the statistics collector's counts), how long ago it was
-- last vacuumed (by autovacuum or by hand) and auto-analyzed, how old the queue is, its heap and index sizes, and the
-- dead-tuple count at which autovacuum vacuums it: threshold + scale_factor * reltuples, from its
-- storage parameters or else the server's settings (capped by autovacuum_vacuum_max_threshold
-- where the server has it, PostgreSQL 18 on).
SELECT q.name AS queue,
       coalesce(s.n_live_tup, 0)::bigint AS live_tuples,
       coalesce(s.n_dead_tup, 0)::bigint AS dead_tuples,
       extract(epoch FROM clock_timestamp() - greatest(s.last_autovacuum, s.last_vacuum))::float8 AS vacuum_age_seconds,
       extract(epoch FROM clock_timestamp() - s.last_autovacuum)::float8 AS autovacuum_age_seconds,
       extract(epoch FROM clock_timestamp() - s.last_autoanalyze)::float8 AS autoanalyze_age_seconds,
       coalesce(s.autovacuum_count, 0)::bigint AS autovacuum_count,
       extract(epoch FROM clock_timestamp() - q.created_at)::float8 AS queue_age_seconds,
       pg_table_size(c.oid)::bigint AS table_bytes,
       pg_indexes_size(c.oid)::bigint AS index_bytes,
       least(coalesce(o.threshold, current_setting('autovacuum_vacuum_threshold')::float8)
             + coalesce(o.scale, current_setting('autovacuum_vacuum_scale_factor')::float8) * greatest(c.reltuples, 0),
             nullif(coalesce(o.max_threshold, current_setting('autovacuum_vacuum_max_threshold', true)::float8), -1)
       )::bigint AS autovacuum_trigger,
       (current_setting('autovacuum')::boolean AND coalesce(o.enabled, true)) AS autovacuum_enabled,
       coalesce(array_to_string(c.reloptions, ','), '') AS reloptions
  FROM qm.queues q
  JOIN pg_class c ON c.oid = to_regclass(format('public.%I', q.name))
  LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
  LEFT JOIN LATERAL (
        SELECT max(option_value) FILTER (WHERE option_name = 'autovacuum_vacuum_threshold')::float8 AS threshold,
               max(option_value) FILTER (WHERE option_name = 'autovacuum_vacuum_scale_factor')::float8 AS scale,
               max(option_value) FILTER (WHERE option_name = 'autovacuum_vacuum_max_threshold')::float8 AS max_threshold,
               max(option_value) FILTER (WHERE option_name = 'autovacuum_enabled')::boolean AS enabled
          FROM pg_options_to_table(c.reloptions)) o ON true
 ORDER BY q.name

-- health_indexes --
-- Per B-tree index of a queue table: its size now, and the statistics-based bloat estimate (the
-- well-known one of ioguix's btree_bloat.sql, simplified for these indexes): the pages the index
-- had at its last vacuum or analyze (pg_class.relpages) against the pages its entries then
-- (pg_class.reltuples) would fill at the index's fillfactor, each entry an 8-byte header plus the
-- average width of its key columns (pg_stats.avg_width, which counts non-null values only: every
-- key column of these indexes is non-null within the index's predicate), MAXALIGNed, plus a 4-byte
-- line pointer, on 8 kB pages less their 24-byte header and 16-byte B-tree trailer. NULL until the
-- table has been analyzed and the index vacuumed or analyzed once. An estimate: it ignores inner
-- pages (under 1 %), and an index whose equal keys PostgreSQL deduplicates (the acked index: one
-- ack batch shares one acked_at) is smaller than estimated, so its bloat is underestimated.
-- pgstattuple's pgstatindex() measures instead of estimating, but reads the whole index.
SELECT q.name AS queue, ci.relname::text AS index_name,
       pg_relation_size(ci.oid)::bigint AS size_bytes,
       CASE WHEN ci.reltuples < 0 OR ci.relpages = 0 OR w.width IS NULL THEN NULL
            ELSE greatest(ci.relpages - (1 + ceil(ci.reltuples
                          / floor((b.bs - 24 - 16) * coalesce(f.ff, 90) / 100.0
                                  / (4 + 8 * ceil((8 + w.width) / 8.0)))))::bigint, 0) * b.bs::bigint
       END AS bloat_bytes,
       CASE WHEN ci.reltuples < 0 OR ci.relpages = 0 OR w.width IS NULL THEN NULL
            ELSE greatest(1 - (1 + ceil(ci.reltuples
                          / floor((b.bs - 24 - 16) * coalesce(f.ff, 90) / 100.0
                                  / (4 + 8 * ceil((8 + w.width) / 8.0))))) / ci.relpages, 0)::float8
       END AS bloat_ratio
  FROM qm.queues q
  JOIN pg_index i ON i.indrelid = to_regclass(format('public.%I', q.name))
  JOIN pg_class ci ON ci.oid = i.indexrelid AND ci.relam = (SELECT oid FROM pg_am WHERE amname = 'btree')
  CROSS JOIN (SELECT current_setting('block_size')::float8 AS bs) b
  LEFT JOIN LATERAL (
        SELECT max(option_value)::float8 AS ff
          FROM pg_options_to_table(ci.reloptions) WHERE option_name = 'fillfactor') f ON true
  LEFT JOIN LATERAL (
        -- a key column's statistics are the table's; an expression's (attnum 0) are the index's own,
        -- under its position; NULL when a key has no statistics yet
        SELECT CASE WHEN count(st.avg_width) = count(*) THEN sum(st.avg_width)::float8 END AS width
          FROM unnest(i.indkey::smallint[]) WITH ORDINALITY AS k(attnum, pos)
          JOIN pg_attribute a ON (k.attnum <> 0 AND a.attrelid = i.indrelid AND a.attnum = k.attnum)
                              OR (k.attnum = 0 AND a.attrelid = i.indexrelid AND a.attnum = k.pos)
          LEFT JOIN pg_stats st ON st.schemaname = 'public' AND NOT st.inherited AND st.attname = a.attname
                               AND st.tablename = CASE WHEN k.attnum <> 0 THEN q.name ELSE ci.relname::text END
         WHERE k.pos <= i.indnkeyatts) w ON true
 ORDER BY q.name, ci.relname

-- health_slots --
-- Replication slots that hold back vacuum (their xmin, or catalog_xmin for logical slots), oldest
-- first. A slot has no age in seconds, only the transactions it holds back (xid_age).
SELECT s.slot_name::text AS name, s.slot_type AS kind, s.active, s.active_pid AS pid,
       s.database::text AS database,
       age(s.xmin)::bigint AS xmin_age, age(s.catalog_xmin)::bigint AS catalog_xmin_age
  FROM pg_replication_slots s
 WHERE s.xmin IS NOT NULL OR s.catalog_xmin IS NOT NULL
 ORDER BY greatest(age(s.xmin), age(s.catalog_xmin)) DESC

-- health_notify --
-- The fraction of the server's NOTIFY queue in use (0 to 1). It grows when a listening session
-- does not consume its notifications (for instance one idle in a transaction); when it is full,
-- every transaction that sends a NOTIFY fails at commit, and the queue tables' producers send some.
SELECT pg_notification_queue_usage()::float8 AS usage
