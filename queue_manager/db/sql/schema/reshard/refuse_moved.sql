-- The function of a queue's qm_moved trigger (BEFORE INSERT OR UPDATE OR DELETE FOR EACH ROW, by
-- anyone but the manager; present while the shard does not serve, see qm.apply_reshard_triggers):
-- refuse the write with the retryable error QMM01, naming the shard that serves the row's tenant
-- now (from qm.shard_map, which a reshard rewrites when it freezes a source). Producers retry there
-- (queue_manager.Router does); an ack by SQL of an event this shard no longer serves is refused, so
-- it cannot be lost: the event is re-fired by the shard that serves it.
CREATE OR REPLACE FUNCTION qm.refuse_moved() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    s qm.shard;
    t text := CASE WHEN TG_OP = 'DELETE' THEN OLD.tenant ELSE NEW.tenant END;
    right_shard text := qm.shard_for(t);
BEGIN
    SELECT * INTO s FROM qm.shard;
    RAISE EXCEPTION 'shard "%" does not serve tenant % now (%): its range is served by shard "%"; retry there',
        s.name, quote_literal(t),
        CASE s.serving WHEN 'pending' THEN 'a reshard has not switched to it yet'
                       WHEN 'frozen' THEN 'a reshard is switching its range to other shards'
                       ELSE 'a reshard moved its range to other shards' END,
        coalesce(right_shard, '<unknown>')
        USING ERRCODE = 'QMM01', DETAIL = 'right_shard=' || coalesce(right_shard, ''),
              HINT = 'reload the topology and retry on the shard named (queue_manager.Router does this)';
END
$$;
