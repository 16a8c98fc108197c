-- Turn the reshard's change capture of this shard on or off (qm_capture_* triggers on every queue).
-- Turning it on waits for every open write of an event, so every change committed after this
-- commits is captured. Turning it off leaves qm.reshard_capture as it is.
CREATE OR REPLACE FUNCTION qm.set_capturing(capturing boolean) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    s qm.shard;
    q qm.queues;
BEGIN
    UPDATE qm.shard SET capturing = set_capturing.capturing, updated_at = now() RETURNING * INTO s;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'this database has no shard identity yet' USING ERRCODE = '55000',
            HINT = 'run: qm migrate --topology <file>';
    END IF;
    FOR q IN SELECT * FROM qm.queues ORDER BY id LOOP
        PERFORM qm.apply_reshard_triggers(q, s);
    END LOOP;
END
$$;
