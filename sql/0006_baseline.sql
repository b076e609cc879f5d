-- Baseline: the tables of the ack claims. The numbered files that held function bodies were
-- squashed into this one (the tables they created) and the repeatable definitions (R__*.sql: every
-- function, applied after the numbered files whenever its text changes). A schema that applied
-- them is at this baseline: its 0006 counts as this file, and none of them is run again or refused.
-- Each line below names a squashed file and the checksum it had when applied.
-- replaces 0006_ack_claims.sql sha256:5030ae6debe4d2a6f751bc43d84e1f0ca349efb11a880b543fc814d395c86eed
-- replaces 0007_sql_functions.sql sha256:be14cfc01596718de2a898f256a5c28c4cbe5ebee060c0fe5fc6c0ec3f168755
-- replaces 0009_settle_trace_context.sql sha256:d1dcf51d99500f2cc89662364e28b454ea12fda5cd0eda821b22b36a884aaa3b
-- replaces 0010_ack_claim_items.sql sha256:917501e4b3811700d1caf32b9178ac23f18416103cfdd8138aa3eb0f822deb60
-- replaces 0012_sql_calls_checked.sql sha256:61052752e7f2d6c5f2f066cd9c43d46a9fdc957a30b4dc122b258365b4cb23c2
-- replaces 0014_least_privilege.sql sha256:d2437b358fa46e14a7e6eb7c97029621b4f7d3a90e29e9f2f50fba5cb0e3fb48
--
-- Acks of one batch run in parallel; completion is still decided exactly once.
--
-- A consumer's ack (tracker.ack, exactly_once) no longer touches the batch or group rows inside
-- the caller's transaction. It inserts one claim per item: the primary key is the per-item
-- exclusion (a concurrent claim of the same item waits on the unique index until the first
-- transaction ends, then finds either its committed claim or, once settled, the cleared bit).
-- Claims are folded into the bits, the pending counts and the completion decision by
-- ack_settle() (R__ack_claims.sql), always under the batch row lock (the lock every writer of a batch's groups
-- holds), so the decision stays serialised while the acks themselves are not:
--   * at the claiming transaction's commit, by a deferred constraint trigger, if the batch row
--     is free right now (SKIP LOCKED: a commit never waits for another batch's settle, so the
--     commits of one batch's acks are group-committed in parallel);
--   * otherwise by whoever settles that batch next (the next committing ack, the reaper's
--     settler, or tracker.settle()), which folds every committed claim of the batch.
-- Runs with search_path set to the configured schema.

CREATE TABLE ack_claim (
    batch_id bigint  NOT NULL,
    group_id bigint  NOT NULL,
    idx      integer NOT NULL,
    PRIMARY KEY (batch_id, group_id, idx)
) WITH (
    -- claims live from an ack to its settle (usually the same commit): vacuum by count, soon
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 10000,
    autovacuum_vacuum_cost_delay = 0
);

-- One row per (transaction, batch) that claimed items: its insert queues the commit-time settle.
-- Rows are inserted and deleted by the same transaction, so none is ever committed: UNLOGGED.
-- outbox/topic: where the claiming caller's tracker writes completion events.
CREATE UNLOGGED TABLE ack_settle_request (
    xid      xid8     NOT NULL DEFAULT pg_current_xact_id(),
    batch_id bigint   NOT NULL,
    outbox   regclass NOT NULL,
    topic    text     NOT NULL,
    PRIMARY KEY (xid, batch_id)
);
