-- Storage parameters of a queue's table for churn. Called by qm.create_queue only, not by
-- qm.apply_queue, so that qm queue alter and qm migrate leave a table's parameters as an operator
-- set them. Safe on a live table: ALTER TABLE SET of these parameters takes a SHARE UPDATE EXCLUSIVE
-- lock, which blocks neither reads nor writes (only another vacuum or DDL), and changes no stored row.
-- The values, from measurements (docs/benchmarks-history.md, "Churn"; docs/operations.md, "Tuning
-- PostgreSQL for queue churn"):
--   autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02
--       vacuum after 2 % of the table changed, not PostgreSQL's 20 % (analyze: 10 %). On a churned
--       queue table the trigger is passed within a second or two (at 500 events/s with 30 s
--       retention, 90 000 dead tuples piled up between two autovacuum visits against a trigger of
--       about 400): what bounds the dead rows is how often vacuum comes (autovacuum_naptime,
--       server-wide, 60 s by default), which the leader makes up for by vacuuming the table itself
--       (qm manager --vacuum-after). The trigger also says when it does.
--   autovacuum_vacuum_cost_limit = 2000
--       ten times the default budget between the throttle's sleeps. VACUUM of a 308 MiB queue table
--       (1 M events, half of them dead) took 5.87 s at the default (200), 2.90 s at 1000, 1.31 s at
--       2000 and 0.36 s unthrottled: 2000 finishes within 4x of unthrottled and still yields to
--       other I/O.
--   fillfactor: left at 100. A queue table's updates are never HOT (design.md, "HOT updates"),
--       so free room on a page only spreads the rows: with fillfactor 70 the heap was 2.2 times
--       as large after 5 minutes of churn (14.8 MB against 6.6 MB).
CREATE OR REPLACE FUNCTION qm.tune_queue_tables(queue_id integer) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    q qm.queues;
BEGIN
    SELECT * INTO q FROM qm.queues WHERE id = queue_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no queue with id % on this shard', queue_id USING ERRCODE = '42P01';
    END IF;
    EXECUTE format('ALTER TABLE public.%I SET (autovacuum_vacuum_scale_factor = 0.02, '
                   'autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_limit = 2000)', q.name);
END
$$;
