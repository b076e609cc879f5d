-- Fan-out tracking: a batch owns groups; a group owns one bit per item (set = pending).
-- Every writer locks the batch row first (adds, closes, acks, the sweeper), so a batch's groups
-- are only ever changed by the holder of its batch row lock.
CREATE TABLE batch (
    id               bigserial   PRIMARY KEY,
    user_key         text,
    state            text        NOT NULL DEFAULT 'open'
                                 CHECK (state IN ('open', 'closed', 'complete', 'expired')),
    total            bigint      NOT NULL DEFAULT 0 CHECK (total >= 0),
    pending          bigint      NOT NULL DEFAULT 0 CHECK (pending >= 0 AND pending <= total),
    next_group       bigint      NOT NULL DEFAULT 0,   -- group ids handed out by add/enqueue
    completion_topic text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    closed_at        timestamptz,
    completed_at     timestamptz,
    expired_at       timestamptz,
    last_activity_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT batch_complete_has_nothing_pending CHECK (state <> 'complete' OR pending = 0)
) WITH (fillfactor = 80);  -- every ack rewrites its batch row: leave room for HOT updates

-- The sweeper's two questions, answered without a scan of every finished batch. Neither index
-- names pending or last_activity_at, so the per-ack batch update stays HOT.
CREATE INDEX batch_unfinished ON batch (id) WHERE state IN ('open', 'closed');
CREATE INDEX batch_finished ON batch ((coalesce(completed_at, expired_at))) WHERE state IN ('complete', 'expired');

-- fillfactor 100: 7 rows of 8192 bits fill a page (~1.15 bits per item at rest); at 70 only 5
-- fit (~1.6). A bulk ack updates every group of a page in one transaction, so HOT would need
-- slack for all of them; dead versions are reclaimed by a prompt autovacuum instead. The
-- measurements and the choice: tracker/batches.py, `python -m bench.tracker`.
CREATE TABLE batch_group (
    batch_id bigint  NOT NULL REFERENCES batch (id) ON DELETE CASCADE,
    id       bigint  NOT NULL CHECK (id >= 0),
    size     integer NOT NULL CHECK (size BETWEEN 1 AND 8192),
    pending  integer NOT NULL CHECK (pending BETWEEN 0 AND size),
    bits     varbit(8192) NOT NULL CHECK (bit_length(bits) = size),
    PRIMARY KEY (batch_id, id)
) WITH (
    fillfactor = 100,
    -- every ack pass leaves one dead ~1.1 KB version per group it touched: vacuum by count, soon
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0
);
-- A bitfield of at most 1 KiB must stay in the row, uncompressed: never TOAST it.
ALTER TABLE batch_group ALTER COLUMN bits SET STORAGE PLAIN;
