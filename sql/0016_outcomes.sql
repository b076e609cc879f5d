-- Outcomes: an item ends succeeded or failed (with a short reason); a batch finishes once with an
-- outcome, early when a failure threshold is crossed; batches nest (a child under an open parent).
-- The functions that use these columns are the repeatable definitions (R__*.sql).
-- Runs with search_path set to the configured schema.

-- Every writer locks a batch's row before its groups (and reads batch before batch_group): so
-- does this migration, else a live ack holding the batch while it waits for batch_group deadlocks
-- with it.
LOCK TABLE batch, batch_group IN ACCESS EXCLUSIVE MODE;

-- Per group: items that failed (succeeded = size - pending - failed). Their bits are cleared as an
-- ack's are, so one pending bit per item stays the whole state of an item.
ALTER TABLE batch_group ADD COLUMN failed integer NOT NULL DEFAULT 0 CHECK (failed >= 0);

-- Per batch: failed items, outcomes recorded after it finished (late), the outcome when it
-- finished, thresholds, the parent and the roll-up of its finished children.
ALTER TABLE batch
    ADD COLUMN failed                  bigint   NOT NULL DEFAULT 0 CHECK (failed >= 0),
    ADD COLUMN late                    bigint   NOT NULL DEFAULT 0 CHECK (late >= 0),
    ADD COLUMN outcome                 text     CHECK (outcome IN ('succeeded', 'failed')),
    ADD COLUMN tolerated_failures      bigint   CHECK (tolerated_failures >= 0),
    ADD COLUMN tolerated_failure_ratio float8   CHECK (tolerated_failure_ratio BETWEEN 0 AND 1),
    ADD COLUMN parent_id               bigint   REFERENCES batch (id) ON DELETE SET NULL,
    ADD COLUMN depth                   smallint NOT NULL DEFAULT 0 CHECK (depth BETWEEN 0 AND 7),
    ADD COLUMN children                integer  NOT NULL DEFAULT 0 CHECK (children >= 0),
    ADD COLUMN children_open           integer  NOT NULL DEFAULT 0 CHECK (children_open >= 0),
    ADD COLUMN children_failed         integer  NOT NULL DEFAULT 0 CHECK (children_failed >= 0),
    ADD COLUMN rollup_total            bigint   NOT NULL DEFAULT 0 CHECK (rollup_total >= 0),
    ADD COLUMN rollup_failed           bigint   NOT NULL DEFAULT 0 CHECK (rollup_failed >= 0);

-- Batches finished before this migration all succeeded (nothing could fail).
UPDATE batch SET outcome = 'succeeded' WHERE state = 'complete';

ALTER TABLE batch
    -- A batch finished early by a threshold has items pending: the old rule no longer holds.
    DROP CONSTRAINT batch_complete_has_nothing_pending,
    ADD CONSTRAINT batch_counts_add_up CHECK (pending + failed <= total);
-- (No check that a complete batch has an outcome: between this file and the repeatable
-- definitions of the same `reaper migrate`, live acks still run the earlier definitions.)

-- Children of a batch, for the cascade of its deletion (retention) and for reading.
CREATE INDEX batch_parent ON batch (parent_id) WHERE parent_id IS NOT NULL;

-- A child that finished (or expired), not yet folded into its parent. The finishing transaction
-- inserts this row and never locks the parent's row (which a producer opening another child, or
-- a consumer acking the parent's own items, may hold for its whole transaction); the parent folds
-- the row in under its own row lock (its close, its acks and failures, a settle), once: the row is
-- deleted as it is folded. The counts are the roll-up the child's own event reports. The foreign
-- key's check takes only a KEY SHARE lock, which no writer of the parent's row conflicts with.
CREATE TABLE child_finished (
    parent_id    bigint  NOT NULL REFERENCES batch (id) ON DELETE CASCADE,
    child_id     bigint  NOT NULL,
    total        bigint  NOT NULL CHECK (total >= 0),   -- its items and its finished descendants'
    failed       bigint  NOT NULL CHECK (failed >= 0),  -- those failed, or pending when it finished or expired
    child_failed boolean NOT NULL,                      -- it did not finish succeeded
    PRIMARY KEY (parent_id, child_id)
);

-- Failure reasons, each text stored once however many items share it (looked up by its digest).
CREATE TABLE failure_reason (
    id     bigserial PRIMARY KEY,
    digest bytea     NOT NULL UNIQUE,  -- sha256 of the text
    text   text      NOT NULL CHECK (length(text) BETWEEN 1 AND 500)
);

-- The failed items of one group with one reason: one row, their bits OR-ed in.
CREATE TABLE group_failure (
    batch_id  bigint       NOT NULL,
    group_id  bigint       NOT NULL,
    reason_id bigint       NOT NULL REFERENCES failure_reason (id),
    bits      varbit(8192) NOT NULL,
    PRIMARY KEY (batch_id, group_id, reason_id),
    FOREIGN KEY (batch_id, group_id) REFERENCES batch_group (batch_id, id) ON DELETE CASCADE
);
