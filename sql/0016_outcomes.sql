-- Outcomes: an item ends succeeded or failed (with a short reason); a batch finishes once with an
-- outcome, early when a failure threshold is crossed; batches nest (a child under an open parent).
-- The functions that use these columns are the repeatable definitions (R__*.sql).
-- Runs with search_path set to the configured schema.

-- Every writer locks a batch's row before its groups (and reads batch before batch_group): so
-- does this migration, else a live ack holding the batch while it waits for batch_group deadlocks
-- with it.
LOCK TABLE batch, batch_group IN ACCESS EXCLUSIVE MODE;

-- Nothing here rewrites a table (measured on Postgres 15): a column added with a constant default
-- is stored in the catalog, not in the rows, and every CHECK is added NOT VALID, so no statement
-- scans the table under this lock to check rows that hold by construction (each new column holds
-- its default, which passes its check; pending + failed <= total is pending <= total, checked
-- since 0002). Rows written or updated from here on are checked as usual. The one read of the
-- table is building the (empty) index batch_parent below: about 0.1 s per million batches.

-- Per group: items that failed (succeeded = size - pending - failed). Their bits are cleared as an
-- ack's are, so one pending bit per item stays the whole state of an item.
ALTER TABLE batch_group
    ADD COLUMN failed integer NOT NULL DEFAULT 0,
    ADD CONSTRAINT batch_group_failed_check CHECK (failed >= 0) NOT VALID;

-- Per batch: failed items, outcomes recorded after it finished (late), the outcome when it
-- finished, thresholds, the parent and the roll-up of its finished children. A batch that finished
-- before this migration has no outcome (NULL): it succeeded, as nothing could fail then, and every
-- reader says so (batch_status, tracker.status). No backfill: an UPDATE of every finished batch
-- would rewrite the table under this lock (8 s per million batches, blocking every ack).
ALTER TABLE batch
    ADD COLUMN failed                  bigint   NOT NULL DEFAULT 0,
    ADD COLUMN late                    bigint   NOT NULL DEFAULT 0,
    ADD COLUMN outcome                 text,
    ADD COLUMN tolerated_failures      bigint,
    ADD COLUMN tolerated_failure_ratio float8,
    ADD COLUMN parent_id               bigint   REFERENCES batch (id) ON DELETE SET NULL,  -- all null: nothing to check
    ADD COLUMN depth                   smallint NOT NULL DEFAULT 0,
    ADD COLUMN children                integer  NOT NULL DEFAULT 0,
    ADD COLUMN children_open           integer  NOT NULL DEFAULT 0,
    ADD COLUMN children_failed         integer  NOT NULL DEFAULT 0,
    ADD COLUMN rollup_total            bigint   NOT NULL DEFAULT 0,
    ADD COLUMN rollup_failed           bigint   NOT NULL DEFAULT 0,
    ADD CONSTRAINT batch_failed_check CHECK (failed >= 0) NOT VALID,
    ADD CONSTRAINT batch_late_check CHECK (late >= 0) NOT VALID,
    ADD CONSTRAINT batch_outcome_check CHECK (outcome IN ('succeeded', 'failed')) NOT VALID,
    ADD CONSTRAINT batch_tolerated_failures_check CHECK (tolerated_failures >= 0) NOT VALID,
    ADD CONSTRAINT batch_tolerated_failure_ratio_check CHECK (tolerated_failure_ratio BETWEEN 0 AND 1) NOT VALID,
    ADD CONSTRAINT batch_depth_check CHECK (depth BETWEEN 0 AND 7) NOT VALID,
    ADD CONSTRAINT batch_children_check CHECK (children >= 0) NOT VALID,
    ADD CONSTRAINT batch_children_open_check CHECK (children_open >= 0) NOT VALID,
    ADD CONSTRAINT batch_children_failed_check CHECK (children_failed >= 0) NOT VALID,
    ADD CONSTRAINT batch_rollup_total_check CHECK (rollup_total >= 0) NOT VALID,
    ADD CONSTRAINT batch_rollup_failed_check CHECK (rollup_failed >= 0) NOT VALID,
    -- A batch finished early by a threshold has items pending: the old rule no longer holds.
    DROP CONSTRAINT batch_complete_has_nothing_pending,
    ADD CONSTRAINT batch_counts_add_up CHECK (pending + failed <= total) NOT VALID;
-- (No check that a complete batch has an outcome: one finished before this migration has none,
-- and between this file and the repeatable definitions of the same `reaper migrate`, live acks
-- still run the earlier definitions.)

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
-- A reason no retained item failed under is deleted by retention (failure_reasons_forget).
CREATE TABLE failure_reason (
    id     bigserial PRIMARY KEY,
    digest bytea     NOT NULL UNIQUE,  -- sha256 of the text
    text   text      NOT NULL CHECK (length(text) BETWEEN 1 AND 500)
);

-- The failed items of one group with one reason: one row, in whichever form is smaller: `items`,
-- their indexes ascending (2 bytes each: a few items, e.g. a reason carrying an id or a time), or
-- `bits`, the group's bit string with their bits set (size / 8 bytes: many items). lo and hi are
-- its first and last item. No other item is in the row: an item fails at most once, so the rows
-- of a group never share an item, and their lo are distinct.
CREATE TABLE group_failure (
    batch_id  bigint       NOT NULL,
    group_id  bigint       NOT NULL,
    lo        smallint     NOT NULL CHECK (lo BETWEEN 0 AND 8191),
    hi        smallint     NOT NULL CHECK (hi BETWEEN lo AND 8191),
    reason_id bigint       NOT NULL REFERENCES failure_reason (id),
    items     smallint[]   CHECK (cardinality(items) BETWEEN 1 AND 8192),
    bits      varbit(8192),
    CHECK ((items IS NULL) <> (bits IS NULL)),
    -- Item order, for a page of failures() and for the cascade of a batch's deletion.
    PRIMARY KEY (batch_id, group_id, lo),
    FOREIGN KEY (batch_id, group_id) REFERENCES batch_group (batch_id, id) ON DELETE CASCADE
);
-- One row per reason and group; by reason, for the check that a reason is no longer used.
CREATE UNIQUE INDEX group_failure_reason ON group_failure (reason_id, batch_id, group_id);
-- The rows of several items that a page may start inside of (lo before its cursor, hi after).
CREATE INDEX group_failure_spans ON group_failure (batch_id, group_id, lo) WHERE hi > lo;
