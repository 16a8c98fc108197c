-- The indexes a retention slice reads: acked events of one partition by ack time, cancelled
-- events by their cancel time (acked_at), and failed events of one partition by their settle time
-- (the expression archive.sql uses). All partial, so none holds a live event. The cancelled index
-- says state > 'failed' (cancelled is the enum's last value): revision 0008_schedules_cancel adds the value and
-- creates this index for the queues of before it in one transaction, which cannot name it.
CREATE OR REPLACE FUNCTION qm.create_retention_indexes(queue_name text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    t text := format('public.%I', queue_name);
BEGIN
    EXECUTE format('CREATE INDEX %I ON %s (partition, acked_at) WHERE state = ''acked''', queue_name || '_acked', t);
    EXECUTE format('CREATE INDEX %I ON %s (partition, acked_at) WHERE state > ''failed''', queue_name || '_cancelled', t);
    EXECUTE format('CREATE INDEX %I ON %s (partition, (coalesce(acked_at, fired_at, created_at))) '
                   'WHERE state = ''failed''', queue_name || '_failed', t);
END
$$;
