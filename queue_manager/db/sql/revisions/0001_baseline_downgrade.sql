-- Revision 0001_baseline, downgraded: every queue table, then every function (with the triggers
-- that call them), table, sequence and type of schema qm, but alembic's version table.
DO $$
DECLARE
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY(SELECT name FROM qm.queues) LOOP
        EXECUTE format('DROP TABLE IF EXISTS public.%I', f);
    END LOOP;
    -- by signature, read before the first drop: a function's drop may cascade to another's
    FOREACH f IN ARRAY ARRAY(SELECT p.oid::regprocedure::text FROM pg_proc p WHERE p.pronamespace = 'qm'::regnamespace) LOOP
        EXECUTE format('DROP FUNCTION IF EXISTS %s CASCADE', f);
    END LOOP;
    -- tables first: an identity column's sequence goes with its table
    FOREACH f IN ARRAY ARRAY(SELECT c.relname FROM pg_class c WHERE c.relnamespace = 'qm'::regnamespace
                                AND c.relkind = 'r' AND c.relname <> 'alembic_version') LOOP
        EXECUTE format('DROP TABLE IF EXISTS qm.%I CASCADE', f);
    END LOOP;
    FOREACH f IN ARRAY ARRAY(SELECT c.relname FROM pg_class c WHERE c.relnamespace = 'qm'::regnamespace
                                AND c.relkind = 'S') LOOP
        EXECUTE format('DROP SEQUENCE IF EXISTS qm.%I', f);
    END LOOP;
    DROP TYPE IF EXISTS qm.event_state;
END
$$;
