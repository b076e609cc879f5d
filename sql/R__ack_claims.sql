-- Fold the committed (and the caller's own) claims of one batch. Returns flipped = NULL when the
-- batch row was locked by someone else and p_wait is false (nothing done: the holder or a later
-- settle folds them). Clears bits only where they are set, lowers group and batch pending by the
-- bits that flipped (flips of a batch already finished count as late; claims of an expired batch
-- are dropped: its counts stay those of its expiry event), then folds in its finished
-- children and finishes what can (batch_finish, R__outcomes.sql: a closed batch whose pending
-- reaches 0 and no child open, and its one completion event).
CREATE OR REPLACE FUNCTION ack_settle(p_batch bigint, p_outbox regclass, p_topic text, p_wait boolean DEFAULT false,
                           OUT flipped bigint, OUT completed boolean)
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
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
    -- An expired batch's counts are final (its expiry event told them): claims that reached it
    -- (validated before the expiry committed: claims lock no batch row, so an expiry does not wait
    -- for a claim in flight; or a REPEATABLE READ claim whose snapshot predated it) are dropped,
    -- nothing flips. Its finished children are still folded in below (batch_finish).
    IF EXISTS (SELECT 1 FROM batch WHERE id = p_batch AND state = 'expired') THEN
        DELETE FROM ack_claim WHERE batch_id = p_batch;
        flipped := 0;
        completed := p_batch = ANY(batch_finish(ARRAY[p_batch], p_outbox, p_topic));
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
    IF flipped > 0 THEN
        UPDATE batch SET pending = pending - flipped, last_activity_at = clock_timestamp(),
               late = late + CASE WHEN state = 'complete' THEN flipped ELSE 0 END
         WHERE id = p_batch;
    END IF;
    -- fold in its finished children, then this settle may finish it: batch_finish (R__outcomes.sql)
    completed := p_batch = ANY(batch_finish(ARRAY[p_batch], p_outbox, p_topic));
END
$$;

-- Commit-time settle of the batches this transaction claimed in. Only READ COMMITTED settles
-- here: a REPEATABLE READ / SERIALIZABLE snapshot would see neither the claims committed after it
-- nor the newest bits, and could fail the caller's commit with a serialization error; its claims
-- are committed and folded by the next settle of the batch instead.
-- SECURITY DEFINER: the trigger fires at the commit of whoever claimed, a consumer role of the SQL
-- functions too, which has no privilege on the tables (a trigger function cannot be called alone).
-- As the owner it writes completion events into the request's outbox: a request is honoured only
-- for a table of this schema and a topic name Kafka accepts, whoever inserted it (the Python API's
-- role may insert requests itself, and must not steer the owner's writes elsewhere).
CREATE OR REPLACE FUNCTION ack_settle_at_commit() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    IF (SELECT c.relnamespace FROM pg_class c WHERE c.oid = NEW.outbox) IS DISTINCT FROM current_schema()::regnamespace THEN
        RAISE EXCEPTION 'an ack settle request names the table %, which is not in schema %', NEW.outbox, current_schema()
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    PERFORM completion_topic_check(NEW.topic);
    DELETE FROM ack_settle_request WHERE xid = NEW.xid AND batch_id = NEW.batch_id;
    IF FOUND AND current_setting('transaction_isolation') = 'read committed' THEN
        PERFORM ack_settle(NEW.batch_id, NEW.outbox, NEW.topic, false);
    END IF;
    RETURN NULL;
END
$$;

DO $$ BEGIN
    IF NOT EXISTS (SELECT FROM pg_trigger WHERE tgrelid = 'ack_settle_request'::regclass
                                          AND tgname = 'ack_settle_at_commit') THEN
        CREATE CONSTRAINT TRIGGER ack_settle_at_commit AFTER INSERT ON ack_settle_request
            DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION ack_settle_at_commit();
    END IF;
END $$;

-- REPEATABLE READ / SERIALIZABLE consumers (tracker.acks.claim_op): are the bits this snapshot
-- shows for these groups still the newest? FOR SHARE raises serialization_failure for a row
-- changed by a transaction that committed after the snapshot; SKIP LOCKED never waits for a row
-- being changed right now (the changer, a settle, may itself wait for this transaction's claims),
-- and such a row fails the check too. The row locks are undone at once (the inner block always
-- raises), so no settle ever waits for them. READ COMMITTED reads the newest bits anyway: no-op.
CREATE OR REPLACE FUNCTION ack_fresh_check(p_batch bigint[], p_group bigint[]) RETURNS void
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

-- A consumer's claim (tracker.acks.claim_op) in one statement: validate, claim, read the bits.
--
-- Before, the claim path sent five statements (states, sizes, claim, read, freshness check),
-- unprepared because they went through a pipeline, and most of a single-id ack's cost on both
-- sides was parsing, planning and exchanging them. This function runs the same statements with
-- PL/pgSQL's cached plans, in the same order and with the same snapshots:
--   1. validation: every named batch exists and is not expired, every group exists, every index
--      is below its group's size. If anything is wrong, NOTHING is claimed and the function
--      returns one row per (batch, group) named, with the batch's state and the group's size
--      (NULL when missing), and `claimed` NULL: the caller raises the typed error naming the id.
--   2. the claim (one row per item; the primary key is the per-item exclusion, waited on when a
--      concurrent transaction holds the same item);
--   3. a new statement (READ COMMITTED: a snapshot taken after the claim's waits) reads each
--      item's bit, returned with whether this call's claim of it is new;
--   4. ack_fresh_check (REPEATABLE READ / SERIALIZABLE: a serialization failure rather than a
--      stale "still pending"; a no-op in READ COMMITTED);
--   5. the commit-time settle request of the batches it claimed in.

CREATE OR REPLACE FUNCTION ack_claim_items(p_batch bigint[], p_group bigint[], p_idx integer[], p_outbox regclass, p_topic text)
RETURNS TABLE (batch_id bigint, group_id bigint, idx integer, state text, size integer, claimed boolean, pending_bit integer)
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
    bad boolean;
    vb bigint[];
    vg bigint[];
    vst text[];
    vsz integer[];
    cb bigint[];
    cg bigint[];
    ci integer[];
BEGIN
    -- One statement, so the error rows are the very rows the decision saw. A NULL or negative
    -- index is refused too (tracker's callers never send one).
    SELECT coalesce(bool_or(v.st IS NULL OR v.st = 'expired' OR v.sz IS NULL OR v.top >= v.sz
                            OR v.low < 0 OR v.nulls > 0), false),
           array_agg(v.b), array_agg(v.g), array_agg(v.st), array_agg(v.sz)
      INTO bad, vb, vg, vst, vsz
      FROM (SELECT u.b, u.g, max(u.i) AS top, min(u.i) AS low, count(*) - count(u.i) AS nulls,
                   min(b.state) AS st, min(g.size) AS sz
              FROM unnest(p_batch, p_group, p_idx) AS u(b, g, i)
              LEFT JOIN batch b ON b.id = u.b
              LEFT JOIN batch_group g ON g.batch_id = u.b AND g.id = u.g
             GROUP BY u.b, u.g) AS v;
    IF bad THEN
        RETURN QUERY SELECT e.b, e.g, NULL::integer, e.st, e.sz, NULL::boolean, NULL::integer
                       FROM unnest(vb, vg, vst, vsz) AS e(b, g, st, sz);
        RETURN;
    END IF;
    -- In (batch, group, index) order, so two calls claiming overlapping items cannot deadlock.
    WITH c AS (INSERT INTO ack_claim (batch_id, group_id, idx)
               SELECT * FROM unnest(p_batch, p_group, p_idx) ORDER BY 1, 2, 3
               ON CONFLICT DO NOTHING RETURNING batch_id, group_id, idx)
    SELECT array_agg(c.batch_id), array_agg(c.group_id), array_agg(c.idx) INTO cb, cg, ci FROM c;
    RETURN QUERY
        SELECT u.b, u.g, u.i, NULL::text, NULL::integer,
               coalesce((u.b, u.g, u.i) IN (SELECT * FROM unnest(cb, cg, ci)), false),
               CASE WHEN u.i < g.size THEN get_bit(g.bits, u.i) END
          FROM unnest(p_batch, p_group, p_idx) AS u(b, g, i)
          JOIN batch_group g ON g.batch_id = u.b AND g.id = u.g;
    PERFORM ack_fresh_check(array_agg(d.b), array_agg(d.g))
       FROM (SELECT DISTINCT u.b, u.g FROM unnest(p_batch, p_group) AS u(b, g)) AS d;
    -- Last, once the bits are read: the commit-time settle request. A caller that runs SET
    -- CONSTRAINTS ALL IMMEDIATE fires its settle at the end of this very statement; had that run
    -- before the read, this claim's own settle would have cleared its bit, and a first ack would
    -- have read as a duplicate (exactly_once then skipping the effect for good).
    INSERT INTO ack_settle_request (batch_id, outbox, topic)
    SELECT DISTINCT b, p_outbox, p_topic FROM unnest(cb) AS b ON CONFLICT DO NOTHING;
END
$$;
