-- Settings changes reach the manager at once (docs/design.md): NOTIFY qm_wake '<queue> settings'
-- when a queue is created or dropped, or any of its settings changes, delivered at commit; the
-- manager reloads its settings instead of waiting for its periodic reload. The UPDATE trigger
-- compares the whole row but the counters' bookkeeping (enq_seqs, done_seqs, updated_at), so that a
-- setting added later needs no new trigger.
CREATE OR REPLACE FUNCTION qm.notify_settings_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- one notice per changed queue, delivered at commit; the manager reloads its settings
    PERFORM pg_notify('qm_wake', coalesce(NEW.name, OLD.name) || ' settings');
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER qm_settings_changed AFTER INSERT OR DELETE ON qm.queues
    FOR EACH ROW EXECUTE FUNCTION qm.notify_settings_changed();

CREATE OR REPLACE TRIGGER qm_settings_updated AFTER UPDATE ON qm.queues
    FOR EACH ROW
    WHEN ((to_jsonb(OLD) - ARRAY['enq_seqs', 'done_seqs', 'updated_at'])
          IS DISTINCT FROM (to_jsonb(NEW) - ARRAY['enq_seqs', 'done_seqs', 'updated_at']))
    EXECUTE FUNCTION qm.notify_settings_changed();
