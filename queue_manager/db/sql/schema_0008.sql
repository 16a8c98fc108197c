-- Revision 0008: adopting a legacy queue table (qm queue adopt, docs/design.md "Adopting a legacy
-- queue table").
--
--   qm.adopted   the adoption ledger, on each shard: one row per legacy event published into one
--                of this shard's queues, written in the same transaction as the event. Its key is
--                the key the event's row got in the legacy database's outbox (a random uuid, never
--                reused), so a re-run after a crash between the two databases' commits finds the
--                event already here and does not publish it twice. A row is needed only until the
--                outbox row is deleted; qm queue adopt then deletes it.

CREATE TABLE qm.adopted (
    key        uuid PRIMARY KEY,
    -- the adoption's name (qm queue adopt --name)
    adoption   text NOT NULL,
    -- which outbox the key came from: '<system identifier>/<database>/<outbox table>'
    source     text NOT NULL,
    queue      text NOT NULL,
    -- the legacy row's id, as text (for an operator reading the ledger)
    legacy_id  text NOT NULL,
    adopted_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX adopted_adoption ON qm.adopted (adoption, source);
