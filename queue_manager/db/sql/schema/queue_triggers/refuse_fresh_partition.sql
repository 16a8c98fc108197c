-- The qm_fresh_partition trigger's function (see qm.apply_queue_triggers): its WHEN clause has
-- already found an UPDATE that makes an event fresh (attempts <= 0) in a partition outside [0, N).
CREATE OR REPLACE FUNCTION qm.refuse_fresh_partition() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'queue "%": event % cannot be fresh (attempts %) in partition %, outside partitions 0..% (rule %_partition_in_shuffle_set)',
        TG_ARGV[0], NEW.id, NEW.attempts, NEW.partition, TG_ARGV[1]::integer - 1, TG_ARGV[0]
        USING ERRCODE = '23514', CONSTRAINT = TG_ARGV[0] || '_partition_in_shuffle_set',
              HINT = 'an event of a dropped partition can be retried only with attempts > 0, or moved to a live partition first';
END
$$;
