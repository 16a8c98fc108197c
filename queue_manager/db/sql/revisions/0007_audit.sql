-- Revision 0007_audit: every operator action is audited (docs/dashboard.md, "Actions"), the CLI's
-- and the admin API's as the dashboard's, so the dashboard's audit table becomes qm.audit. An
-- action that touches several shards writes one row on each (its part there), in the same
-- transaction as its change on that shard, since no transaction spans two shards; the rows of one
-- action share its action_id, and the audit page shows them as one line with the counts per shard.
ALTER TABLE qm.web_audit RENAME TO audit;
ALTER SEQUENCE qm.web_audit_id_seq RENAME TO audit_id_seq;
ALTER TABLE qm.audit
    -- the action this row is a part of (NULL: a row of before this revision, an action of its own)
    ADD COLUMN action_id uuid,
    -- where it was taken: web (the dashboard), cli (qm), api (a program calling queue_manager.admin)
    ADD COLUMN via text NOT NULL DEFAULT 'web',
    -- the whole action's plan: per shard it meant to touch, how many events it bound there (null:
    -- every event matching, as found; or a settings change), so that a shard it never reached shows
    ADD COLUMN plan jsonb;
CREATE UNIQUE INDEX audit_action ON qm.audit (action_id);
COMMENT ON TABLE qm.audit IS 'qm: operator actions (dashboard, CLI, admin API), one row per action and shard it touched';
COMMENT ON COLUMN qm.audit.requested IS 'events the action asked for on this shard (bound, or looked at)';
COMMENT ON COLUMN qm.audit.affected IS 'events it changed on this shard, counted in the transaction of each change';
