-- Issue 12: acks of one batch run in parallel; completion is still decided exactly once.
--
-- A consumer's ack (tracker.ack, exactly_once) no longer touches the batch or group rows inside
-- the caller's transaction. It inserts one claim per item: the primary key is the per-item
-- exclusion (a concurrent claim of the same item waits on the unique index until the first
-- transaction ends, then finds either its committed claim or, once settled, the cleared bit).
-- Claims are folded into the bits, the pending counts and the completion decision by
-- ack_settle(), always under the batch row lock (the lock every writer of a batch's groups
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

-- Fold the committed (and the caller's own) claims of one batch. Returns flipped = NULL when the
-- batch row was locked by someone else and p_wait is false (nothing done: the holder or a later
-- settle folds them). Clears bits only where they are set, lowers group and batch pending by the
-- bits that flipped, completes a closed batch whose pending reaches 0 and writes its single
-- completion event (same content as tracker.batches.completion_insert).
CREATE FUNCTION ack_settle(p_batch bigint, p_outbox regclass, p_topic text, p_wait boolean DEFAULT false,
                           OUT flipped bigint, OUT completed boolean)
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    b batch;
BEGIN
    completed := false;
    IF p_wait THEN
        PERFORM 1 FROM batch WHERE id = p_batch FOR NO KEY UPDATE;
    ELSE
        PERFORM 1 FROM batch WHERE id = p_batch FOR NO KEY UPDATE SKIP LOCKED;
    END IF;
    IF NOT FOUND THEN
        IF NOT EXISTS (SELECT 1 FROM batch WHERE id = p_batch) THEN
            DELETE FROM ack_claim WHERE batch_id = p_batch;  -- the batch was deleted (retention)
            flipped := 0;
        END IF;
        RETURN;
    END IF;
    -- A new statement: in READ COMMITTED it sees every claim committed before the lock was ours.
    WITH c AS (DELETE FROM ack_claim WHERE batch_id = p_batch RETURNING group_id, idx),
    m AS (SELECT g.id, bit_or(set_bit(g.bits # g.bits, c.idx, 1)) AS mask  -- (bits # bits: zeros, no parse)
            FROM c JOIN batch_group g ON g.batch_id = p_batch AND g.id = c.group_id AND c.idx < g.size
           GROUP BY g.id),
    f AS (SELECT m.id, m.mask, bit_count(g.bits & m.mask) AS n
            FROM m JOIN batch_group g ON g.batch_id = p_batch AND g.id = m.id),
    u AS (UPDATE batch_group g SET bits = g.bits & ~f.mask, pending = g.pending - f.n
            FROM f WHERE g.batch_id = p_batch AND g.id = f.id AND f.n > 0)
    SELECT coalesce(sum(f.n), 0) INTO flipped FROM f;
    IF flipped = 0 THEN
        RETURN;
    END IF;
    UPDATE batch SET pending = pending - flipped, last_activity_at = clock_timestamp(),
           state = CASE WHEN state = 'closed' AND pending = flipped THEN 'complete' ELSE state END,
           completed_at = CASE WHEN state = 'closed' AND pending = flipped THEN clock_timestamp()
                          ELSE completed_at END
     WHERE id = p_batch
    RETURNING * INTO b;
    IF b.state = 'complete' THEN  -- flipped > 0, so it was not complete before: this settle completed it
        completed := true;
        EXECUTE format('INSERT INTO %s (topic, key, value, header_keys, header_values) VALUES ($1, $2, $3, $4, $5)',
                       p_outbox)
          USING coalesce(b.completion_topic, p_topic), convert_to(b.id::text, 'UTF8'),
                convert_to(json_build_object('batch_id', b.id, 'user_key', b.user_key, 'total', b.total,
                           'opened_at', b.created_at, 'closed_at', b.closed_at,
                           'completed_at', b.completed_at)::text, 'UTF8'),
                ARRAY['batch-id'], ARRAY[convert_to(b.id::text, 'UTF8')];
    END IF;
END
$$;

-- Commit-time settle of the batches this transaction claimed in. Only READ COMMITTED settles
-- here: a REPEATABLE READ / SERIALIZABLE snapshot would see neither the claims committed after it
-- nor the newest bits, and could fail the caller's commit with a serialization error; its claims
-- are committed and folded by the next settle of the batch instead.
CREATE FUNCTION ack_settle_at_commit() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    DELETE FROM ack_settle_request WHERE xid = NEW.xid AND batch_id = NEW.batch_id;
    IF FOUND AND current_setting('transaction_isolation') = 'read committed' THEN
        PERFORM ack_settle(NEW.batch_id, NEW.outbox, NEW.topic, false);
    END IF;
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER ack_settle_at_commit AFTER INSERT ON ack_settle_request
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION ack_settle_at_commit();

-- REPEATABLE READ / SERIALIZABLE consumers (tracker.acks.claim_op): are the bits this snapshot
-- shows for these groups still the newest? FOR SHARE raises serialization_failure for a row
-- changed by a transaction that committed after the snapshot; SKIP LOCKED never waits for a row
-- being changed right now (the changer, a settle, may itself wait for this transaction's claims),
-- and such a row fails the check too. The row locks are undone at once (the inner block always
-- raises), so no settle ever waits for them. READ COMMITTED reads the newest bits anyway: no-op.
CREATE FUNCTION ack_fresh_check(p_batch bigint[], p_group bigint[]) RETURNS void
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    n bigint := 0;
BEGIN
    IF current_setting('transaction_isolation') = 'read committed' THEN
        RETURN;
    END IF;
    BEGIN
        SELECT count(*) INTO n FROM (
            SELECT 1 FROM unnest(p_batch, p_group) AS u(b, g)
              JOIN batch_group g ON g.batch_id = u.b AND g.id = u.g
               FOR SHARE OF g SKIP LOCKED) AS locked;
        RAISE EXCEPTION USING ERRCODE = 'raise_exception';  -- roll the row locks back
    EXCEPTION WHEN raise_exception THEN
        NULL;
    END;
    IF n < cardinality(p_batch) THEN
        RAISE EXCEPTION 'could not serialize ack: a group of batch % is being updated concurrently; retry the transaction',
              p_batch[1] USING ERRCODE = 'serialization_failure';
    END IF;
END
$$;
