-- Revision 0005_reshard: online resharding (docs/operations.md, "Resharding"; queue_manager/reshard).
--
-- qm.shard.serving: whether this shard serves its range. 'serving' is the normal state. A target
-- of a reshard is 'pending' until the switch; a source is 'frozen' during the cut-over and 'moved'
-- after it. A shard that does not serve grants no leadership (qm.acquire_leadership) and refuses
-- every write of an event but the manager's with the retryable error QMM01 naming the shard that
-- serves the tenant (qm.refuse_moved, from qm.shard_map).
-- qm.shard.capturing: the change capture of a reshard is on: every insert, update and delete of an
-- event is recorded in qm.reshard_capture (qm.reshard_capture_rows).
ALTER TABLE qm.shard
    ADD COLUMN serving text NOT NULL DEFAULT 'serving' CHECK (serving IN ('serving', 'pending', 'frozen', 'moved')),
    ADD COLUMN capturing boolean NOT NULL DEFAULT false;

-- The changed events of this shard not yet applied to the other side of a reshard: (queue, id,
-- tenant) per changed row, in any order and with repeats; the applier re-reads the current row by
-- id and deletes the entries it applied (never a watermark: sequence order is not commit order).
CREATE TABLE qm.reshard_capture (
    seq    bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue  text NOT NULL,
    id     bigint NOT NULL,
    tenant text NOT NULL
);
COMMENT ON TABLE qm.reshard_capture IS 'qm: events changed while a reshard copies this shard (queue, id, tenant)';

-- On the receiving side of a reshard: which local row holds an event copied from another shard
-- (origin shard, its id there). Ids are kept when they are free here and renumbered otherwise
-- (two sources of a merge number their events alike).
CREATE TABLE qm.reshard_rows (
    queue     text NOT NULL,
    origin    text NOT NULL,
    origin_id bigint NOT NULL,
    local_id  bigint NOT NULL,
    PRIMARY KEY (queue, origin, origin_id)
);
CREATE UNIQUE INDEX reshard_rows_local ON qm.reshard_rows (queue, local_id);
COMMENT ON TABLE qm.reshard_rows IS 'qm: events copied here by a reshard: origin shard and id -> local id';
