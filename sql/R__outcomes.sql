-- Outcomes: how a batch finishes, and the masked path that records acks and failures.
--
-- One pending bit per item is the whole state of an item: an ack clears it (succeeded), a failure
-- clears it too (failed) and records the bits it flipped under its reason. The first terminal
-- outcome that commits wins; a later ack or failure of the item is a duplicate. Counts move only by
-- the bits that actually flipped, under the batch row lock, so pending + succeeded + failed = total
-- per group and per batch at every commit (succeeded = total - pending - failed).
--
-- Lock order: a batch's row before its groups. A finishing child never locks its parent's row (it
-- leaves a child_finished row that the parent folds in under its own lock: batch_finish).
-- Statements that lock several batches lock them in descending id order.
-- Runs with search_path set to the configured schema.


-- The id of a failure reason, stored once per text (by its sha256), with a KEY SHARE lock on its
-- row until the transaction ends: retention (failure_reasons_forget) never deletes a reason that a
-- failing transaction is about to store items under. KEY SHARE locks do not conflict with each
-- other (nor with anything but the deletion of the row), so failing transactions sharing a reason
-- never wait on each other, but for the insert of a new reason by two of them at once.
CREATE OR REPLACE FUNCTION failure_reason_id(p_text text) RETURNS bigint
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    d bytea := sha256(convert_to(p_text, 'UTF8'));
    rid bigint;
BEGIN
    FOR attempt IN 1..3 LOOP
        -- Waits for a retention deleting it; the row then is gone and is inserted anew below.
        SELECT r.id INTO rid FROM failure_reason r WHERE r.digest = d FOR KEY SHARE;
        IF FOUND THEN
            RETURN rid;
        END IF;
        INSERT INTO failure_reason (digest, text) VALUES (d, p_text) ON CONFLICT (digest) DO NOTHING RETURNING id INTO rid;
        IF rid IS NOT NULL THEN
            RETURN rid;
        END IF;
        -- Inserted by a transaction that committed while we waited: the next statement sees it.
    END LOOP;
    RAISE EXCEPTION 'could not serialize failure: reason inserted and deleted concurrently; retry the transaction'
        USING ERRCODE = 'serialization_failure';
END $$;


-- Delete the reasons among p_ids that no failed item is stored under any more: retention calls it,
-- in the transaction that deleted batches, with the reasons their failed items had (so its cost is
-- that of what it deleted, never a scan of every reason). A reason that a failing transaction holds
-- (failure_reason_id) is skipped, never waited for: that transaction is storing items under it.
-- Returns how many reasons were deleted.
CREATE OR REPLACE FUNCTION failure_reasons_forget(p_ids bigint[]) RETURNS integer
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    mine bigint[];
    n integer;
BEGIN
    SELECT array_agg(r.id) INTO mine
      FROM (SELECT r.id FROM failure_reason r WHERE r.id = ANY(p_ids) ORDER BY r.id FOR UPDATE SKIP LOCKED) r;
    IF mine IS NULL THEN
        RETURN 0;
    END IF;
    -- A new statement, so a new snapshot: every use of these reasons committed before their locks
    -- were ours is seen here, and a failing transaction wanting one now waits for this one to end
    -- (then inserts it anew): no reason is deleted from under an item, no item stored without one.
    DELETE FROM failure_reason r
     WHERE r.id = ANY(mine) AND NOT EXISTS (SELECT FROM group_failure f WHERE f.reason_id = r.id);
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;


-- The indexes of the bits set in p_bits after index p_after (-1: from the first), ascending, at
-- most p_lim: each found by position() on the rest of the string, never a walk bit by bit.
CREATE OR REPLACE FUNCTION failure_bits_items(p_bits varbit, p_after integer, p_lim integer) RETURNS SETOF integer
LANGUAGE plpgsql IMMUTABLE STRICT SET search_path FROM CURRENT AS $$
DECLARE
    i integer := p_after + 1;
    k integer;
    n integer := 0;
    len integer := bit_length(p_bits);
BEGIN
    WHILE n < p_lim AND i < len LOOP
        k := position(B'1' IN substring(p_bits FROM i + 1));
        EXIT WHEN k = 0;
        i := i + k - 1;
        RETURN NEXT i;
        i := i + 1;
        n := n + 1;
    END LOOP;
END $$;


-- The failed items of one group_failure row (its items, or the bits set in its bits) after index
-- p_after (-1: from the first), ascending, at most p_lim. Items: a binary search (width_bucket
-- counts the items <= p_after), then a slice.
CREATE OR REPLACE FUNCTION failure_row_items(p_items smallint[], p_bits varbit, p_after integer, p_lim integer)
RETURNS SETOF integer LANGUAGE plpgsql IMMUTABLE SET search_path FROM CURRENT AS $$
DECLARE
    k integer;
BEGIN
    IF p_items IS NULL THEN
        RETURN QUERY SELECT failure_bits_items(p_bits, p_after, p_lim);
        RETURN;
    END IF;
    k := CASE WHEN p_after < 0 THEN 0 ELSE width_bucket(p_after::smallint, p_items) END;
    RETURN QUERY SELECT unnest(p_items[k + 1 : k + p_lim])::integer;
END $$;


-- A group_failure row (p_items or p_bits; both null: none yet) with p_n more items, the bits set in
-- p_new (none already in the row: an item fails once), in whichever form is smaller: a smallint[]
-- takes 20 bytes of header and 2 per item, a varbit 4 and one bit per index of the group. With
-- its first and last item.
CREATE OR REPLACE FUNCTION failure_row_add(p_items smallint[], p_bits varbit, p_new varbit, p_n integer,
                                           OUT items smallint[], OUT bits varbit, OUT lo smallint, OUT hi smallint)
LANGUAGE plpgsql IMMUTABLE SET search_path FROM CURRENT AS $$
DECLARE
    len integer := greatest(bit_length(p_new), coalesce(bit_length(p_bits), 0));  -- the group may have grown
    n integer := coalesce(cardinality(p_items), 0) + coalesce(bit_count(p_bits), 0)::integer + p_n;
    i integer;
BEGIN
    IF 2 * n + 20 <= (len + 7) / 8 + 4 THEN
        SELECT array_agg(u.x ORDER BY u.x) INTO items
          FROM (SELECT unnest(p_items) AS x
                UNION ALL SELECT failure_bits_items(p_bits, -1, 8192)::smallint
                UNION ALL SELECT failure_bits_items(p_new, -1, p_n)::smallint) u;
        lo := items[1];
        hi := items[cardinality(items)];
        RETURN;
    END IF;
    bits := p_new || repeat('0', len - bit_length(p_new))::varbit;
    IF p_bits IS NOT NULL THEN
        bits := bits | (p_bits || repeat('0', len - bit_length(p_bits))::varbit);
    END IF;
    FOREACH i IN ARRAY coalesce(p_items, '{}') LOOP
        bits := set_bit(bits, i, 1);
    END LOOP;
    lo := position(B'1' IN bits) - 1;
    hi := length(rtrim(bits::text, '0')) - 1;
END $$;


-- Fold the finished children of batch p_id into it, under its row lock (the caller's): each
-- child_finished row once (deleted as it is folded): children_open - 1, the child's roll-up into
-- rollup_total and rollup_failed, children_failed + 1 unless it succeeded. Returns how many.
-- Its statement is a new one: in READ COMMITTED it sees every row committed before the lock was ours.
CREATE OR REPLACE FUNCTION batch_fold(p_id bigint) RETURNS bigint
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    n bigint;
BEGIN
    WITH f AS (DELETE FROM child_finished c WHERE c.parent_id = p_id
               RETURNING c.total, c.failed, c.child_failed),
    s AS (SELECT count(*) AS n, sum(f.total) AS t, sum(f.failed) AS fl,
                 count(*) FILTER (WHERE f.child_failed) AS cf FROM f),
    u AS (UPDATE batch p SET children_open = p.children_open - s.n, rollup_total = p.rollup_total + s.t,
                 rollup_failed = p.rollup_failed + s.fl, children_failed = p.children_failed + s.cf,
                 last_activity_at = clock_timestamp()
            FROM s WHERE p.id = p_id AND s.n > 0)
    SELECT s.n INTO n FROM s;
    RETURN n;
END $$;


-- Finish what can finish, under the row locks the caller holds on p_ids. Each batch first folds
-- in its children that finished since (batch_fold). Then a batch that is open or closed finishes (state
-- complete, an outcome, its one completion event into p_outbox) when
--   * it is closed, nothing is pending and no child is open: outcome succeeded, or failed when
--     an item or a child failed;
--   * more failed than tolerated_failures (its own failed items plus those rolled up from its
--     finished children), open or closed: early, outcome failed;
--   * it is closed, no child is open and its failed items (with the roll-up) are more than
--     tolerated_failure_ratio of its items (with the roll-up): early when items are still pending.
-- A batch with a parent that finishes here (or expires anywhere) leaves its child_finished row for
-- that parent (the trigger batch_child_finished, below) and never locks the parent's row: lock
-- order is never child then parent, so two
-- transactions finishing children of two trees cannot deadlock, and a child's final ack never
-- waits for a transaction holding its parent (a producer opening another child). The parent folds
-- the row in at the next moment that locks it anyway: its close, its own acks or failures, or a
-- settle (tracker.settle, the reaper's claim settler, which looks for batches with child_finished
-- rows): a parent finishes at the first of those after its last child, within the settler's
-- interval. Up the chain likewise, one level per fold.
-- The one roll-up rule: a child adds to its parent exactly the roll-up its own completion or expiry
-- event reports (sql/R__events.sql): total = its items and its finished descendants' items,
-- failed = those that failed or were still pending when it finished or expired. A descendant that
-- finishes after its parent finished is folded into that parent only (no further up).
-- A parent already finished or expired folds its children all the same but emits nothing more.
-- Returns the batches finished here.
-- (Its earlier form also took the ids of batches just expired, to leave their rows: the trigger does.)
DROP FUNCTION IF EXISTS batch_finish(bigint[], regclass, text, bigint[]);
CREATE OR REPLACE FUNCTION batch_finish(p_ids bigint[], p_outbox regclass, p_topic text) RETURNS bigint[]
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    todo bigint[] := coalesce(p_ids, '{}');
    done bigint[] := '{}';
    cur bigint;
    b batch;
BEGIN
    LOOP
        EXIT WHEN cardinality(todo) = 0;
        cur := todo[1];
        todo := todo[2:];
        PERFORM batch_fold(cur);
        UPDATE batch x SET state = 'complete', completed_at = clock_timestamp(),
               outcome = CASE WHEN x.pending > 0 OR x.failed > 0 OR x.rollup_failed > 0 OR x.children_failed > 0
                                   OR x.children_open > 0 THEN 'failed' ELSE 'succeeded' END
         WHERE x.id = cur AND x.state IN ('open', 'closed')
           AND ((x.state = 'closed' AND x.pending = 0 AND x.children_open = 0)
                OR x.failed + x.rollup_failed > x.tolerated_failures
                OR (x.state = 'closed' AND x.children_open = 0
                    -- in numeric: in float8, 0.29 * 100 is 28.999999999999996, and exactly 29%
                    -- failed would count as more than 29%
                    AND x.failed + x.rollup_failed > x.tolerated_failure_ratio::numeric * (x.total + x.rollup_total)))
        RETURNING * INTO b;
        IF FOUND THEN
            done := done || cur;
            EXECUTE format('INSERT INTO %s (topic, key, value, header_keys, header_values) '
                           'SELECT * FROM completion_event($1, $2)', p_outbox) USING b, p_topic;
        END IF;
    END LOOP;
    RETURN done;
END $$;


-- Record masks of acks (p_reason NULL) or failures (p_reason: their reason) under the batch row
-- locks the caller holds (descending id order): p_hex[k] is the hex of group (p_batch[k],
-- p_group[k])'s bits, index i being bit (7 - i % 8) of byte i / 8, cut or zero-padded to the
-- group's size. Clears the bits still set, lowers pending (and raises failed) by the bits that
-- flipped, counts flips of a finished batch as late, stores failed items under their reason, then
-- folds in the named batches' finished children and finishes what can (batch_finish). One row per batch named: bits flipped, whether it finished
-- here. Validation is the caller's (tracker.core.acks.apply_op, ack_masks).
-- Before any bit is read, the named batches' committed claims (and the caller's own) are settled
-- (ack_settle, R__ack_claims.sql): an ack is a claim until its settle, and a failure that read the
-- bits past it would fail an item whose ack committed first (the first outcome committed wins).
CREATE OR REPLACE FUNCTION outcome_apply(p_batch bigint[], p_group bigint[], p_hex text[], p_reason text,
                                         p_outbox regclass, p_topic text)
RETURNS TABLE (batch_id bigint, flipped bigint, completed boolean)
LANGUAGE plpgsql SET search_path FROM CURRENT SET jit = off AS $$
#variable_conflict use_column
DECLARE
    rid bigint;
    finished bigint[];
    touched bigint[];
    fb bigint[];
    fg bigint[];
    fm varbit[];
    fn bigint[];
    settled bigint[];
BEGIN
    SELECT coalesce(array_agg(c.b) FILTER (WHERE (ack_settle(c.b, p_outbox, p_topic, true)).completed), '{}')
      INTO settled
      FROM (SELECT DISTINCT u.b FROM unnest(p_batch) AS u(b)
             WHERE EXISTS (SELECT 1 FROM ack_claim a WHERE a.batch_id = u.b) ORDER BY u.b DESC) AS c;
    WITH u AS (
        SELECT u.b, u.g, bit_or(substring(('x' || rpad(u.hex, ((g.size + 7) / 8) * 2, '0'))::varbit FROM 1 FOR g.size)) AS mask
          FROM unnest(p_batch, p_group, p_hex) AS u(b, g, hex)
          JOIN batch_group g ON g.batch_id = u.b AND g.id = u.g
         GROUP BY u.b, u.g),
    f AS MATERIALIZED (SELECT u.b, u.g, g.bits & u.mask AS mask, bit_count(g.bits & u.mask) AS n
                         FROM u JOIN batch_group g ON g.batch_id = u.b AND g.id = u.g),
    cleared AS (
        UPDATE batch_group g SET bits = g.bits & ~f.mask, pending = g.pending - f.n,
               failed = g.failed + CASE WHEN p_reason IS NULL THEN 0 ELSE f.n END
          FROM f WHERE g.batch_id = f.b AND g.id = f.g AND f.n > 0)
    SELECT array_agg(f.b), array_agg(f.g), array_agg(f.mask), array_agg(f.n) INTO fb, fg, fm, fn FROM f;
    IF fb IS NULL THEN
        RETURN;
    END IF;
    IF p_reason IS NOT NULL AND 0 < ANY(fn) THEN  -- a reason is stored only when an item failed under it
        rid := failure_reason_id(p_reason);
        -- The items that failed here join the group's row for the reason, in the same call that
        -- cleared their bits (one statement of the caller's), under the batch row lock: no other
        -- writer of the row meanwhile.
        INSERT INTO group_failure AS gf (batch_id, group_id, lo, hi, reason_id, items, bits)
        SELECT o.b, o.g, a.lo, a.hi, rid, a.items, a.bits
          FROM unnest(fb, fg, fm, fn) AS o(b, g, m, n)
          LEFT JOIN group_failure old ON old.reason_id = rid AND old.batch_id = o.b AND old.group_id = o.g
         CROSS JOIN LATERAL failure_row_add(old.items, old.bits, o.m, o.n::integer) a
         WHERE o.n > 0
        ON CONFLICT (reason_id, batch_id, group_id) DO UPDATE
           SET lo = excluded.lo, hi = excluded.hi, items = excluded.items, bits = excluded.bits;
    END IF;
    WITH d AS (SELECT o.b, sum(o.n)::int8 AS n FROM unnest(fb, fn) AS o(b, n) GROUP BY o.b),
    b AS (UPDATE batch b SET pending = b.pending - d.n,
                 failed = b.failed + CASE WHEN p_reason IS NULL THEN 0 ELSE d.n END,
                 late = b.late + CASE WHEN b.state = 'complete' THEN d.n ELSE 0 END,
                 last_activity_at = clock_timestamp()
            FROM d WHERE b.id = d.b AND d.n > 0 RETURNING b.id)
    SELECT array_agg(b.id ORDER BY b.id DESC) INTO touched FROM b;
    -- Every batch named (all locked by the caller), flipped or not: each folds in its finished children.
    SELECT array_agg(DISTINCT o.b ORDER BY o.b DESC) INTO touched FROM unnest(fb) AS o(b);
    finished := batch_finish(touched, p_outbox, p_topic);
    RETURN QUERY
        SELECT o.b, sum(o.n)::int8, o.b = ANY(finished || settled)
          FROM unnest(fb, fn) AS o(b, n) GROUP BY o.b ORDER BY o.b;
END $$;


-- A writer of the previous release (a consumer or producer not yet redeployed when `reaper
-- migrate` ran) completes a batch with its own statement, which sets state 'complete' and no
-- outcome, then builds the completion event from the row it updated. This trigger gives that row
-- the outcome batch_finish would have given it, so the row and its event always have one.
CREATE OR REPLACE FUNCTION batch_outcome_of_old_writer() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    NEW.outcome := CASE WHEN NEW.pending > 0 OR NEW.failed > 0 OR NEW.rollup_failed > 0 OR NEW.children_failed > 0
                             OR NEW.children_open > 0 THEN 'failed' ELSE 'succeeded' END;
    RETURN NEW;
END $$;

DO $$ BEGIN
    IF NOT EXISTS (SELECT FROM pg_trigger WHERE tgrelid = 'batch'::regclass AND tgname = 'batch_outcome_of_old_writer') THEN
        CREATE TRIGGER batch_outcome_of_old_writer BEFORE UPDATE OF state ON batch
            FOR EACH ROW WHEN (NEW.state = 'complete' AND NEW.outcome IS NULL)
            EXECUTE FUNCTION batch_outcome_of_old_writer();
    END IF;
END $$;


-- A child that finishes or expires leaves its roll-up for its parent: whichever statement moves it
-- from open or closed to complete or expired (batch_finish, the sweeper's and the operator's
-- expiry, and a writer of the previous release, which knows nothing of parents), the row is written
-- in that statement's transaction and never locks the parent's row (the foreign key's check takes
-- KEY SHARE, which only a deletion of the parent conflicts with: retention deletes no parent with
-- a child open). The counts are the roll-up its completion or expiry event reports.
CREATE OR REPLACE FUNCTION batch_child_finished() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    INSERT INTO child_finished (parent_id, child_id, total, failed, child_failed)
    VALUES (NEW.parent_id, NEW.id, NEW.total + NEW.rollup_total, NEW.pending + NEW.failed + NEW.rollup_failed,
            NEW.outcome IS DISTINCT FROM 'succeeded')
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END $$;

DO $$ BEGIN
    IF NOT EXISTS (SELECT FROM pg_trigger WHERE tgrelid = 'batch'::regclass AND tgname = 'batch_child_finished') THEN
        CREATE TRIGGER batch_child_finished AFTER UPDATE OF state ON batch
            FOR EACH ROW WHEN (NEW.parent_id IS NOT NULL AND OLD.state IN ('open', 'closed')
                               AND NEW.state IN ('complete', 'expired'))
            EXECUTE FUNCTION batch_child_finished();
    END IF;
END $$;
