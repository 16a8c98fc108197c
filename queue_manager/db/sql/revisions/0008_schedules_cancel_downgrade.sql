-- Revision 0008_schedules_cancel, undone: the schedules go. Cancelled events stay cancelled (an
-- enum value cannot be dropped); their retention indexes go.
DROP TABLE qm.schedules;
DO $$
DECLARE
    q record;
BEGIN
    FOR q IN SELECT name FROM qm.queues LOOP
        EXECUTE format('DROP INDEX IF EXISTS public.%I', q.name || '_cancelled');
    END LOOP;
END
$$;
