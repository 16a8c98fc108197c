-- The default of a queue table's priority column: the queue's default_priority, so that a row that
-- leaves priority out (a plain INSERT, a COPY, the Spark loader) gets it. Changed only when it
-- differs: ALTER TABLE ... SET DEFAULT takes the table's ACCESS EXCLUSIVE lock for a moment, which
-- would queue behind any open transaction that read the table (qm.apply_queue runs at every alter
-- and migration).
CREATE OR REPLACE FUNCTION qm.apply_queue_default(q qm.queues) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    current text;
BEGIN
    SELECT pg_get_expr(d.adbin, d.adrelid) INTO current
      FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
     WHERE a.attrelid = format('public.%I', q.name)::regclass AND a.attname = 'priority' AND NOT a.attisdropped;
    IF current IS DISTINCT FROM q.default_priority::text THEN
        EXECUTE format('ALTER TABLE public.%I ALTER COLUMN priority SET DEFAULT %s', q.name, q.default_priority);
    END IF;
END
$$;
