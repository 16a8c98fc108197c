-- A key's limits changed by qm.set_key / qm.unset_key (or by hand) reach the manager at once, as a
-- queue setting does: NOTIFY qm_wake '<queue> settings', delivered at commit.
CREATE OR REPLACE FUNCTION qm.notify_key_settings_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('qm_wake', q.name || ' settings')
       FROM qm.queues q WHERE q.id = coalesce(NEW.queue_id, OLD.queue_id);
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER qm_key_settings_changed AFTER INSERT OR UPDATE OR DELETE ON qm.key_settings
    FOR EACH ROW EXECUTE FUNCTION qm.notify_key_settings_changed();
