-- Revision 0003_web_audit: the web dashboard's audit table (docs/dashboard.md, "Actions"). One row
-- per action and shard: the token name that acted, the action, the queue, the filter or the
-- selection as shown on the confirmation page, how many events it asked for on this shard, how
-- many it changed (bumped in each slice's own transaction, so an interrupted action still tells
-- the truth), and when it began and ended.
CREATE TABLE qm.web_audit (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT now(),
    actor       text NOT NULL,
    action      text NOT NULL,
    queue       text,
    filter      text NOT NULL DEFAULT '',
    requested   integer NOT NULL DEFAULT 0,
    affected    integer NOT NULL DEFAULT 0,
    finished_at timestamptz
);

COMMENT ON TABLE qm.web_audit IS 'qm: actions taken from the web dashboard (qm web), one row per action and shard';
