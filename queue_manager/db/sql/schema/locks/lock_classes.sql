-- Every advisory lock class, one per purpose: the SQL side of queue_manager/db/locks.py, which
-- says what each key is (tests/unit/test_lock_registry.py checks that the two lists are the same).
-- Every advisory lock is the two-key form pg_advisory*(class, key), its class spelled
-- qm.lock_class('<purpose>'); in pg_locks, classid is the class, objid the key, objsubid 2. The
-- numbers of classes no longer used (29038, 29040) are not given to another purpose.
--   SELECT l.purpose, k.objid, k.mode, k.pid
--     FROM pg_locks k JOIN qm.lock_classes() l ON l.lock_class = k.classid
--    WHERE k.locktype = 'advisory' AND k.objsubid = 2;
CREATE OR REPLACE FUNCTION qm.lock_classes() RETURNS TABLE (purpose text, lock_class integer)
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    VALUES ('migration', 29036),    -- key 0: one migration of the database at a time
           ('wake', 29037),         -- key: queue id; a waiting manager's wake-up lock
           ('maintenance', 29039),  -- key: the job's position in qm.maintenance_jobs()
           ('adopt', 29041),        -- key: hashtext(adoption name); one run of an adoption
           ('spark_run', 29042),    -- key: hashtext(queue || chr(31) || run id); one live Spark run
           ('dedup', 29043),        -- key: hashtext(queue id || chr(31) || tenant || chr(31) || dedup key)
           ('reshard', 29044)       -- key 0: one reshard process at a time, on every shard it involves
$$;
