-- Revision 0007_audit, undone: the dashboard's audit table again (the CLI's rows stay in it).
DROP INDEX qm.audit_action;
ALTER TABLE qm.audit DROP COLUMN action_id, DROP COLUMN via, DROP COLUMN plan;
ALTER SEQUENCE qm.audit_id_seq RENAME TO web_audit_id_seq;
ALTER TABLE qm.audit RENAME TO web_audit;
COMMENT ON TABLE qm.web_audit IS 'qm: actions taken from the web dashboard (qm web), one row per action and shard';
