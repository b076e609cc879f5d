-- Tracker functions for producers and consumers in any language, inside their own transaction:
--   open_batch(user_key, completion_topic, parent, tolerated_failures, tolerated_failure_ratio) -> batch id
--   add_items(batch, items)                            -> group handles (batch_id, group_id, start, upto)
--   enqueue(batch, topic, payloads, key, header_keys, header_values, keys) -> group handles
--   close_batch(batch, completion_topic)               -> true if the batch is complete
--   ack(ids, completion_topic)                         -> (acked, duplicates, completed batch ids)
--   ack_masks(batch_ids, group_ids, masks, completion_topic) -> (acked, completed)   (pre-folded masks)
--   fail(ids, reason, completion_topic)                -> (failed, duplicates, completed batch ids)
--   fail_masks(batch_ids, group_ids, masks, reason, completion_topic) -> (failed, completed)
--   failures(batch, after, lim)                        -> (item_id, reason) rows, a page
--   batch_status(batch)                                -> one row, as tracker.status()
-- Same invariants as the Python API (tracker/batches.py, tracker/acks.py): every writer locks the
-- batch row first; groups hold at most 8192 bits; completion happens in exactly one transaction
-- and writes exactly one completion event into the outbox.
--
-- Errors are raised with SQLSTATEs of class RT; the message names the offending value and DETAIL
-- holds it exactly as the caller wrote it (item id or run, or the batch id):
--   RT001 malformed item id      RT002 unknown batch        RT003 unknown group
--   RT004 index out of range     RT005 batch not open (add to a closed, complete or expired batch)
--   RT006 batch expired          RT007 invalid argument
-- A raised error undoes the whole call (and, as any SQL error, aborts the caller's transaction:
-- wrap the call in a SAVEPOINT to carry on after it).
--
-- Every function is created with `SET search_path FROM CURRENT` (set just below): the schema
-- `reaper migrate` installs into (and nothing from the caller's search_path) resolves the tables
-- they name. And
-- with `SET jit = off`: their set-returning steps are estimated at thousands of rows, and JIT
-- compiling the fold of one 10k-id ack took ~2.3 s of a 2.7 s call (measured, PG 15).


CREATE OR REPLACE FUNCTION completion_topic_check(topic text, nullable boolean DEFAULT false) RETURNS void
LANGUAGE plpgsql IMMUTABLE SET search_path FROM CURRENT AS $$
BEGIN
    IF topic IS NULL THEN
        IF nullable THEN
            RETURN;
        END IF;
        RAISE EXCEPTION 'completion_topic must be a non-empty string, got null' USING ERRCODE = 'RT007', DETAIL = 'null';
    END IF;
    IF topic = '' THEN
        RAISE EXCEPTION 'completion_topic must be a non-empty string, got an empty string'
            USING ERRCODE = 'RT007', DETAIL = '';
    END IF;
    PERFORM topic_name_check(topic, 'completion_topic');
END $$;


-- A name Kafka accepts for a topic: at most 249 characters of ASCII letters, digits, '.', '_' and
-- '-', not '.' or '..', nor one of Kafka's internal topics, which the broker refuses to producers
-- (as tracker.core.validate.check_topic). `what` names the argument.
CREATE OR REPLACE FUNCTION topic_name_check(topic text, what text) RETURNS void
LANGUAGE plpgsql IMMUTABLE SET search_path FROM CURRENT AS $$
BEGIN
    IF length(topic) > 249 THEN
        RAISE EXCEPTION '% % is longer than Kafka''s 249 characters', what, quote_literal(left(topic, 60) || '...')
            USING ERRCODE = 'RT007', DETAIL = left(topic, 60);
    END IF;
    IF topic !~ '^[A-Za-z0-9._-]+$' OR topic IN ('.', '..') THEN
        RAISE EXCEPTION '% % is not a Kafka topic name (ASCII letters, digits, ''.'', ''_'' and ''-'' only; not ''.'' or ''..'')',
            what, quote_literal(topic) USING ERRCODE = 'RT007', DETAIL = topic;
    END IF;
    IF topic IN ('__consumer_offsets', '__transaction_state', '__share_group_state', '__cluster_metadata',
                 '__remote_log_metadata') THEN
        RAISE EXCEPTION '% % is one of Kafka''s internal topics, which producers may not write', what, quote_literal(topic)
            USING ERRCODE = 'RT007', DETAIL = topic;
    END IF;
END $$;


-- A failure reason: 1 to 500 characters (refused, not cut: what the caller wrote is what is stored).
CREATE OR REPLACE FUNCTION failure_reason_check(reason text) RETURNS void
LANGUAGE plpgsql IMMUTABLE SET search_path FROM CURRENT AS $$
BEGIN
    IF reason IS NULL OR reason = '' THEN
        RAISE EXCEPTION 'reason must be a non-empty string, got %', coalesce(quote_literal(reason), 'null')
            USING ERRCODE = 'RT007', DETAIL = coalesce(reason, 'null');
    END IF;
    IF length(reason) > 500 THEN
        RAISE EXCEPTION 'reason % is longer than 500 characters (% characters)', quote_literal(left(reason, 60) || '...'),
            length(reason) USING ERRCODE = 'RT007', DETAIL = left(reason, 60);
    END IF;
END $$;


-- open_batch gained parent and thresholds: its two-argument form is dropped in this transaction.
DROP FUNCTION IF EXISTS open_batch(text, text);
DROP FUNCTION IF EXISTS batch_status(bigint);

CREATE OR REPLACE FUNCTION open_batch(user_key text DEFAULT NULL, completion_topic text DEFAULT NULL,
                                      parent bigint DEFAULT NULL, tolerated_failures bigint DEFAULT NULL,
                                      tolerated_failure_ratio float8 DEFAULT NULL)
RETURNS bigint LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT SET jit = off AS $$
DECLARE
    new_id bigint;
    st text;
    d smallint := 0;
BEGIN
    PERFORM completion_topic_check(open_batch.completion_topic, true);
    -- Stored and indexed (the batch_user_key index holds an entry of at most about 2.7 kB): capped
    -- as tracker.core.validate.check_user_key caps it.
    IF length(open_batch.user_key) > 1000 OR octet_length(open_batch.user_key) > 2000 THEN
        RAISE EXCEPTION 'user_key % is longer than 1000 characters or 2000 bytes in UTF-8 (% characters, % bytes)',
            quote_literal(left(open_batch.user_key, 60) || '...'), length(open_batch.user_key),
            octet_length(open_batch.user_key) USING ERRCODE = 'RT007', DETAIL = left(open_batch.user_key, 60);
    END IF;
    IF open_batch.completion_topic = '' THEN
        RAISE EXCEPTION 'completion_topic must be a non-empty string or null, got an empty string'
            USING ERRCODE = 'RT007', DETAIL = '';
    END IF;
    IF open_batch.tolerated_failures < 0 THEN
        RAISE EXCEPTION 'tolerated_failures must be >= 0, got %', open_batch.tolerated_failures
            USING ERRCODE = 'RT007', DETAIL = open_batch.tolerated_failures::text;
    END IF;
    IF NOT (open_batch.tolerated_failure_ratio BETWEEN 0 AND 1) THEN
        RAISE EXCEPTION 'tolerated_failure_ratio must be between 0 and 1, got %', open_batch.tolerated_failure_ratio
            USING ERRCODE = 'RT007', DETAIL = open_batch.tolerated_failure_ratio::text;
    END IF;
    IF open_batch.parent IS NOT NULL THEN
        UPDATE batch p SET children = p.children + 1, children_open = p.children_open + 1,
               last_activity_at = clock_timestamp()
         WHERE p.id = open_batch.parent AND p.state = 'open' AND p.depth < 7
        RETURNING p.depth + 1 INTO d;
        IF NOT FOUND THEN
            SELECT p.state, p.depth INTO st, d FROM batch p WHERE p.id = open_batch.parent;
            IF NOT FOUND THEN
                RAISE EXCEPTION 'unknown batch % (parent)', open_batch.parent
                    USING ERRCODE = 'RT002', DETAIL = open_batch.parent::text;
            ELSIF st <> 'open' THEN
                RAISE EXCEPTION 'parent batch % is %: children can only be opened under an open batch', open_batch.parent, st
                    USING ERRCODE = 'RT005', DETAIL = open_batch.parent::text;
            END IF;
            RAISE EXCEPTION 'parent batch % is at depth %: batches nest at most 8 levels', open_batch.parent, d
                USING ERRCODE = 'RT007', DETAIL = open_batch.parent::text;
        END IF;
    END IF;
    INSERT INTO batch (user_key, completion_topic, parent_id, depth, tolerated_failures, tolerated_failure_ratio)
    VALUES (open_batch.user_key, open_batch.completion_topic, open_batch.parent, d,
            open_batch.tolerated_failures, open_batch.tolerated_failure_ratio)
    RETURNING id INTO new_id;
    RETURN new_id;
END $$;


-- The failed items of a batch with their reasons, in (group, index) order after the item id
-- `after` (null: from the start), at most `lim` (1 to 1000) rows. The next page starts after the
-- last item id returned; fewer than `lim` rows: the last page. Walks group by group, each found by
-- one index probe. In a group, the items of a page after index a are in the rows (one per reason,
-- sorted by their first item lo, no item in two rows) with lo > a, the first `lim` of them by lo
-- (a later row's every item comes after `lim` earlier ones), and in the rows of several items with
-- lo <= a < hi. From each row only its items after a are read, at most `lim` (a binary search in
-- its items, or position() in its bits): a page costs O(lim + groups visited), whatever the
-- number of failed items or reasons of a group, plus the rows of several items it starts inside of.
CREATE OR REPLACE FUNCTION failures(batch bigint, after text DEFAULT NULL, lim integer DEFAULT 100)
RETURNS TABLE (item_id text, reason text)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path FROM CURRENT SET jit = off AS $$
#variable_conflict use_column
DECLARE
    ag bigint := -1;
    ai integer := -1;
    a integer;
    parts text[];
    g bigint;
    left_n integer;
    n integer;
BEGIN
    IF failures.lim IS NULL OR failures.lim < 1 OR failures.lim > 1000 THEN
        RAISE EXCEPTION 'lim must be between 1 and 1000, got %', coalesce(failures.lim::text, 'null')
            USING ERRCODE = 'RT007', DETAIL = coalesce(failures.lim::text, 'null');
    END IF;
    IF NOT EXISTS (SELECT 1 FROM batch b WHERE b.id = failures.batch) THEN
        RAISE EXCEPTION 'unknown batch %', coalesce(failures.batch::text, 'null')
            USING ERRCODE = 'RT002', DETAIL = coalesce(failures.batch::text, 'null');
    END IF;
    IF failures.after IS NOT NULL THEN
        parts := regexp_match(failures.after, '^(0|[1-9][0-9]{0,18}):(0|[1-9][0-9]{0,18}):(0|[1-9][0-9]{0,3})$');
        IF parts IS NULL OR parts[1]::numeric <> failures.batch OR parts[2]::numeric > 9223372036854775807
           OR parts[3]::integer >= 8192 THEN
            RAISE EXCEPTION 'after % is not an item id of batch %', quote_literal(failures.after), failures.batch
                USING ERRCODE = 'RT007', DETAIL = failures.after;
        END IF;
        ag := parts[2]::bigint;
        ai := parts[3]::integer;
    END IF;
    left_n := failures.lim;
    g := (SELECT min(f.group_id) FROM group_failure f WHERE f.batch_id = failures.batch AND f.group_id >= greatest(ag, 0));
    WHILE g IS NOT NULL LOOP
        a := CASE WHEN g = ag THEN ai ELSE -1 END;
        RETURN QUERY
            SELECT failures.batch || ':' || g || ':' || x.i, r.text
              FROM (SELECT f.reason_id, f.items, f.bits FROM group_failure f
                     WHERE f.batch_id = failures.batch AND f.group_id = g AND f.lo <= a AND f.hi > a AND f.hi > f.lo
                    UNION ALL
                    (SELECT f.reason_id, f.items, f.bits FROM group_failure f
                      WHERE f.batch_id = failures.batch AND f.group_id = g AND f.lo > a
                      ORDER BY f.lo LIMIT left_n)) f
             CROSS JOIN LATERAL failure_row_items(f.items, f.bits, a, left_n) AS x(i)
              JOIN failure_reason r ON r.id = f.reason_id
             ORDER BY x.i
             LIMIT left_n;
        GET DIAGNOSTICS n = ROW_COUNT;
        left_n := left_n - n;
        EXIT WHEN left_n <= 0;
        g := (SELECT min(f.group_id) FROM group_failure f WHERE f.batch_id = failures.batch AND f.group_id > g);
    END LOOP;
END $$;


-- Track `items` more items: top up the batch's last group, then new groups of at most 8192 bits.
-- A call adds at most 1,073,741,824 items (131,072 groups, 128 MiB of bits: the Python API's bound).
CREATE OR REPLACE FUNCTION add_items(batch bigint, items bigint)
RETURNS TABLE (batch_id bigint, group_id bigint, start integer, upto integer)
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT SET jit = off AS $$
#variable_conflict use_column
DECLARE
    st text;
    nxt bigint;
    old_size integer;
    k integer;
    left_n bigint;
    n_new bigint;
BEGIN
    IF add_items.batch IS NULL THEN
        RAISE EXCEPTION 'batch must not be null' USING ERRCODE = 'RT007', DETAIL = 'batch';
    END IF;
    IF add_items.items IS NULL OR add_items.items < 0 OR add_items.items > 1073741824 THEN
        RAISE EXCEPTION 'the number of items to add must be between 0 and 1073741824, got %', coalesce(add_items.items::text, 'null')
            USING ERRCODE = 'RT007', DETAIL = coalesce(add_items.items::text, 'null');
    END IF;
    SELECT b.state, b.next_group INTO st, nxt FROM batch b WHERE b.id = add_items.batch FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown batch %', add_items.batch USING ERRCODE = 'RT002', DETAIL = add_items.batch::text;
    END IF;
    IF st <> 'open' THEN
        RAISE EXCEPTION 'batch % is %: items can only be added to an open batch', add_items.batch, st
            USING ERRCODE = 'RT005', DETAIL = add_items.batch::text;
    END IF;
    IF add_items.items = 0 THEN
        RETURN;
    END IF;
    left_n := add_items.items;
    IF nxt > 0 THEN
        SELECT g.size INTO old_size FROM batch_group g WHERE g.batch_id = add_items.batch AND g.id = nxt - 1;
        IF old_size < 8192 THEN
            k := least(left_n, 8192 - old_size);
            UPDATE batch_group g SET size = g.size + k, pending = g.pending + k, bits = g.bits || repeat('1', k)::varbit
            WHERE g.batch_id = add_items.batch AND g.id = nxt - 1;
            batch_id := add_items.batch; group_id := nxt - 1; start := old_size; upto := old_size + k;
            RETURN NEXT;
            left_n := left_n - k;
        END IF;
    END IF;
    IF left_n > 0 THEN
        n_new := (left_n + 8191) / 8192;
        INSERT INTO batch_group (batch_id, id, size, pending, bits)
        SELECT add_items.batch, nxt + s.i, s.size, s.size, repeat('1', s.size)::varbit
        FROM (SELECT i, least(8192, left_n - i * 8192)::integer AS size FROM generate_series(0, n_new - 1) i) s;
        RETURN QUERY
            SELECT add_items.batch, nxt + s.i, 0, least(8192, left_n - s.i * 8192)::integer
            FROM generate_series(0, n_new - 1) s(i);
        nxt := nxt + n_new;
    END IF;
    UPDATE batch b SET total = b.total + add_items.items, pending = b.pending + add_items.items, next_group = nxt,
        last_activity_at = clock_timestamp()
    WHERE b.id = add_items.batch;
END $$;


-- One outbox message per payload (a null payload is a tombstone), tracked in `batch`, in one call.
-- Message k (1-based) of the call is item index start + (k - 1 - items before its group) of the
-- handles returned, in group order. Every message carries the headers item-id and batch-id, then
-- the call's header_keys/header_values. `key` is every message's key unless `keys` (one per
-- payload, null = use `key`) says otherwise. Without this function: add_items, then an INSERT
-- into outbox per item (README, "From any language: SQL").
CREATE OR REPLACE FUNCTION enqueue(batch bigint, topic text, payloads bytea[], key bytea DEFAULT NULL,
                        header_keys text[] DEFAULT '{}', header_values bytea[] DEFAULT '{}',
                        keys bytea[] DEFAULT NULL)
RETURNS TABLE (batch_id bigint, group_id bigint, start integer, upto integer)
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT SET jit = off AS $$
#variable_conflict use_column
DECLARE
    h record;
    gids bigint[] := '{}';
    starts integer[] := '{}';
    uptos integer[] := '{}';
BEGIN
    IF enqueue.topic IS NULL OR enqueue.topic = '' THEN
        RAISE EXCEPTION 'topic must be a non-empty string, got %', coalesce(quote_literal(enqueue.topic), 'null')
            USING ERRCODE = 'RT007', DETAIL = 'topic';
    END IF;
    PERFORM topic_name_check(enqueue.topic, 'topic');
    IF enqueue.payloads IS NULL OR coalesce(array_ndims(enqueue.payloads), 1) <> 1 THEN
        RAISE EXCEPTION 'payloads must be a one-dimensional array (null elements are tombstones)'
            USING ERRCODE = 'RT007', DETAIL = 'payloads';
    END IF;
    -- Kafka headers are a flat list: a nested array would be published as nonsense, or not at all.
    IF array_ndims(enqueue.header_keys) > 1 THEN
        RAISE EXCEPTION 'header_keys must be a one-dimensional array, got % dimensions: %',
            array_ndims(enqueue.header_keys), left(enqueue.header_keys::text, 200)
            USING ERRCODE = 'RT007', DETAIL = 'header_keys';
    END IF;
    IF array_ndims(enqueue.header_values) > 1 THEN
        RAISE EXCEPTION 'header_values must be a one-dimensional array, got % dimensions',
            array_ndims(enqueue.header_values) USING ERRCODE = 'RT007', DETAIL = 'header_values';
    END IF;
    IF enqueue.header_keys IS NULL OR enqueue.header_values IS NULL
       OR cardinality(enqueue.header_keys) <> cardinality(enqueue.header_values) THEN
        RAISE EXCEPTION 'header_keys and header_values must be arrays of the same length'
            USING ERRCODE = 'RT007', DETAIL = 'header_keys';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(enqueue.header_keys) n WHERE n IS NULL OR n = '' OR n IN ('item-id', 'batch-id')) THEN
        RAISE EXCEPTION 'header names must be non-empty and not item-id or batch-id (set by the tracker on every message), got %',
            enqueue.header_keys::text USING ERRCODE = 'RT007', DETAIL = 'header_keys';
    END IF;
    IF enqueue.keys IS NOT NULL AND cardinality(enqueue.keys) <> cardinality(enqueue.payloads) THEN
        RAISE EXCEPTION 'keys must have one element per payload (% payloads, % keys)',
            cardinality(enqueue.payloads), cardinality(enqueue.keys) USING ERRCODE = 'RT007', DETAIL = 'keys';
    END IF;
    FOR h IN SELECT * FROM add_items(enqueue.batch, cardinality(enqueue.payloads)) LOOP
        gids := gids || h.group_id; starts := starts || h.start; uptos := uptos || h.upto;
        batch_id := h.batch_id; group_id := h.group_id; start := h.start; upto := h.upto;
        RETURN NEXT;
    END LOOP;
    IF cardinality(gids) = 0 THEN
        RETURN;
    END IF;
    -- Payload k goes to the group whose running item count covers it; ids are inserted in k order.
    INSERT INTO outbox (topic, key, value, header_keys, header_values)
    SELECT enqueue.topic, coalesce(p.item_key, enqueue.key), p.payload,
           ARRAY['item-id', 'batch-id'] || enqueue.header_keys,
           ARRAY[convert_to(enqueue.batch || ':' || g.gid || ':' || (g.st + (p.k - 1 - g.before)), 'UTF8'),
                 convert_to(enqueue.batch::text, 'UTF8')] || enqueue.header_values
    FROM unnest(enqueue.payloads, enqueue.keys) WITH ORDINALITY p(payload, item_key, k)
    JOIN (SELECT u.gid, u.st, u.up,
                 coalesce(sum(u.up - u.st) OVER (ORDER BY u.gid ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS before
          FROM unnest(gids, starts, uptos) u(gid, st, up)) g
      ON p.k - 1 >= g.before AND p.k - 1 < g.before + (g.up - g.st)
    WHERE p.k <= cardinality(enqueue.payloads)
    ORDER BY p.k;
END $$;


CREATE OR REPLACE FUNCTION close_batch(batch bigint, completion_topic text DEFAULT 'batch-completions')
RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT SET jit = off AS $$
DECLARE
    st text;
BEGIN
    PERFORM completion_topic_check(close_batch.completion_topic);
    UPDATE batch b SET state = 'closed', closed_at = clock_timestamp(), last_activity_at = clock_timestamp()
     WHERE b.id = close_batch.batch AND b.state = 'open';
    IF FOUND THEN
        RETURN close_batch.batch = ANY(batch_finish(ARRAY[close_batch.batch], 'outbox'::regclass, close_batch.completion_topic));
    END IF;
    SELECT b.state INTO st FROM batch b WHERE b.id = close_batch.batch;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown batch %', coalesce(close_batch.batch::text, 'null')
            USING ERRCODE = 'RT002', DETAIL = coalesce(close_batch.batch::text, 'null');
    END IF;
    IF st = 'expired' THEN
        RAISE EXCEPTION 'batch % has expired', close_batch.batch USING ERRCODE = 'RT006', DETAIL = close_batch.batch::text;
    END IF;
    RETURN st = 'complete';
END $$;


CREATE OR REPLACE FUNCTION batch_status(batch bigint)
RETURNS TABLE (state text, total bigint, pending bigint, user_key text, created_at timestamptz,
               closed_at timestamptz, completed_at timestamptz, last_activity_at timestamptz, expired_at timestamptz,
               outcome text, succeeded bigint, failed bigint, late bigint, parent_id bigint, children_open integer,
               children integer, children_failed integer)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path FROM CURRENT SET jit = off AS $$
#variable_conflict use_column
BEGIN
    -- A complete batch without an outcome finished before outcomes existed: it succeeded.
    RETURN QUERY SELECT b.state, b.total, b.pending, b.user_key, b.created_at, b.closed_at, b.completed_at,
                        b.last_activity_at, b.expired_at,
                        coalesce(b.outcome, CASE WHEN b.state = 'complete' THEN 'succeeded' END), b.total - b.pending - b.failed, b.failed,
                        b.late, b.parent_id, b.children_open, b.children, b.children_failed
                 FROM batch b WHERE b.id = batch_status.batch;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown batch %', coalesce(batch_status.batch::text, 'null')
            USING ERRCODE = 'RT002', DETAIL = coalesce(batch_status.batch::text, 'null');
    END IF;
END $$;


-- Apply folded masks: masks[k] is the hex of group (batch_ids[k], group_ids[k])'s bits to clear,
-- index i being bit (7 - i % 8) of byte i / 8 (Postgres' bit-string order; tracker.ids.GroupMask).
-- Validation order and errors follow tracker.acks.apply_masks: first any unknown or expired batch
-- (in array order), then any unknown group or index beyond its group's size (in array order).
--
-- ACK APPLY: the one place where the SQL functions clear bits. It is the same set-based update as
-- tracker/acks.py (`apply`): lock the batches in id order, one UPDATE of the groups' bits and
-- pending counts by the bits that actually flipped, one UPDATE of the batches, completion and its
-- event for batches that became closed with nothing pending. Switch this body if acks move to
-- another path.
CREATE OR REPLACE FUNCTION outcome_masks(batch_ids bigint[], group_ids bigint[], masks text[],
                          completion_topic text, reason text)
RETURNS TABLE (acked bigint, completed bigint[])
LANGUAGE plpgsql SET search_path FROM CURRENT SET jit = off AS $$
#variable_conflict use_column
DECLARE
    bad record;
BEGIN
    PERFORM completion_topic_check(outcome_masks.completion_topic);
    IF outcome_masks.reason IS NOT NULL THEN
        PERFORM failure_reason_check(outcome_masks.reason);
    END IF;
    IF batch_ids IS NULL OR group_ids IS NULL OR masks IS NULL
       OR cardinality(batch_ids) <> cardinality(group_ids) OR cardinality(batch_ids) <> cardinality(masks) THEN
        RAISE EXCEPTION 'batch_ids, group_ids and masks must be arrays of the same length'
            USING ERRCODE = 'RT007', DETAIL = 'masks';
    END IF;
    SELECT u.ord, u.b, u.g, u.hex INTO bad
    FROM unnest(batch_ids, group_ids, masks) WITH ORDINALITY u(b, g, hex, ord)
    WHERE u.b IS NULL OR u.g IS NULL OR u.b < 0 OR u.g < 0 OR u.hex IS NULL
       OR u.hex !~ '^[0-9A-Fa-f]*$' OR length(u.hex) > 2048
    ORDER BY u.ord LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'mask % (batch %, group %) must be non-null ids >= 0 and at most 2048 hex digits',
            bad.ord, coalesce(bad.b::text, 'null'), coalesce(bad.g::text, 'null')
            USING ERRCODE = 'RT007', DETAIL = 'masks[' || bad.ord || ']';
    END IF;

    -- Masks as bit strings (whole bytes); masks with no bit set are left out. No temporary table:
    -- the arrays are unnested again by each statement below, which is cheap.
    PERFORM 1 FROM batch b WHERE b.id IN (SELECT u.b FROM unnest(batch_ids) u(b)) ORDER BY b.id DESC FOR NO KEY UPDATE;

    SELECT t.b, t.g, t.first_bit, b.state INTO bad
    FROM (SELECT u.ord, u.b, u.g, position(B'1' IN ('x' || u.hex)::varbit) - 1 AS first_bit
          FROM unnest(batch_ids, group_ids, masks) WITH ORDINALITY u(b, g, hex, ord)) t
    LEFT JOIN batch b ON b.id = t.b
    WHERE t.first_bit >= 0 AND (b.id IS NULL OR b.state = 'expired') ORDER BY t.ord LIMIT 1;
    IF FOUND THEN
        IF bad.state IS NULL THEN
            RAISE EXCEPTION 'unknown batch % (item id ''%:%:%'')', bad.b, bad.b, bad.g, bad.first_bit
                USING ERRCODE = 'RT002', DETAIL = bad.b || ':' || bad.g || ':' || bad.first_bit;
        END IF;
        RAISE EXCEPTION 'batch % has expired (item id ''%:%:%'')', bad.b, bad.b, bad.g, bad.first_bit
            USING ERRCODE = 'RT006', DETAIL = bad.b || ':' || bad.g || ':' || bad.first_bit;
    END IF;
    SELECT t.b, t.g, t.first_bit, g.size,
           g.size + position(B'1' IN substring(t.m FROM g.size + 1)) - 1 AS beyond
    INTO bad
    FROM (SELECT u.ord, u.b, u.g, mb.m, position(B'1' IN mb.m) - 1 AS first_bit
          FROM unnest(batch_ids, group_ids, masks) WITH ORDINALITY u(b, g, hex, ord),
               LATERAL (SELECT ('x' || u.hex)::varbit AS m) mb) t
    LEFT JOIN batch_group g ON g.batch_id = t.b AND g.id = t.g
    WHERE t.first_bit >= 0 AND (g.size IS NULL OR position(B'1' IN substring(t.m FROM g.size + 1)) > 0)
    ORDER BY t.ord LIMIT 1;
    IF FOUND THEN
        IF bad.size IS NULL THEN
            RAISE EXCEPTION 'unknown group % in batch % (item id ''%:%:%'')', bad.g, bad.b, bad.b, bad.g, bad.first_bit
                USING ERRCODE = 'RT003', DETAIL = bad.b || ':' || bad.g || ':' || bad.first_bit;
        END IF;
        RAISE EXCEPTION 'item id ''%:%:%'' is out of range: its group has % items (index 0..%)',
            bad.b, bad.g, bad.beyond, bad.size, bad.size - 1
            USING ERRCODE = 'RT004', DETAIL = bad.b || ':' || bad.g || ':' || bad.beyond;
    END IF;

    RETURN QUERY
    SELECT coalesce(sum(r.flipped), 0)::int8,
           coalesce(array_agg(r.batch_id ORDER BY r.batch_id) FILTER (WHERE r.completed), '{}')
      FROM outcome_apply(batch_ids, group_ids, masks, outcome_masks.reason, 'outbox'::regclass,
                         outcome_masks.completion_topic) r;
END $$;


-- ack_masks: acks; fail_masks: failures under one reason (at most 500 characters). Both record
-- pre-folded masks through outcome_masks; `acked` counts the items this call flipped.
CREATE OR REPLACE FUNCTION ack_masks(batch_ids bigint[], group_ids bigint[], masks text[],
                          completion_topic text DEFAULT 'batch-completions')
RETURNS TABLE (acked bigint, completed bigint[])
LANGUAGE sql SECURITY DEFINER SET search_path FROM CURRENT SET jit = off AS $$
    SELECT * FROM outcome_masks(batch_ids, group_ids, masks, completion_topic, NULL)
$$;

CREATE OR REPLACE FUNCTION fail_masks(batch_ids bigint[], group_ids bigint[], masks text[], reason text,
                          completion_topic text DEFAULT 'batch-completions')
RETURNS TABLE (failed bigint, completed bigint[])
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT SET jit = off AS $$
BEGIN
    PERFORM failure_reason_check(fail_masks.reason);
    RETURN QUERY SELECT * FROM outcome_masks(batch_ids, group_ids, masks, completion_topic, fail_masks.reason);
END $$;


-- Why an ack entry is malformed, raised exactly as tracker.ids.parse_ack would (first problem wins).
CREATE OR REPLACE FUNCTION ack_entry_error(entry text) RETURNS void
LANGUAGE plpgsql IMMUTABLE SET search_path FROM CURRENT SET jit = off AS $$
DECLARE
    parts text[];
    part text;
    start_s text;
    end_s text;
    dash integer;
    s integer;
    e integer;
BEGIN
    IF entry IS NULL THEN
        RAISE EXCEPTION 'malformed item id null (expected ''<batch>:<group>:<index>'' or ''<batch>:<group>:<start>-<end>'')'
            USING ERRCODE = 'RT001', DETAIL = 'null';
    END IF;
    parts := string_to_array(entry, ':');
    IF coalesce(cardinality(parts), 0) <> 3 THEN
        RAISE EXCEPTION 'malformed item id %: needs exactly three '':''-separated parts', quote_literal(entry)
            USING ERRCODE = 'RT001', DETAIL = entry;
    END IF;
    dash := position('-' IN parts[3]);
    start_s := CASE WHEN dash > 0 THEN left(parts[3], dash - 1) ELSE parts[3] END;
    end_s := CASE WHEN dash > 0 THEN substr(parts[3], dash + 1) END;
    -- The batch and group ids (n = 1, 2), then the index or the run's start and end (n = 3, 4).
    FOR n IN 1..4 LOOP
        part := (ARRAY[parts[1], parts[2], start_s, end_s])[n];
        CONTINUE WHEN part IS NULL;
        IF part !~ '^[0-9]+$' THEN
            RAISE EXCEPTION 'malformed item id %: % is not a non-negative decimal', quote_literal(entry), quote_literal(part)
                USING ERRCODE = 'RT001', DETAIL = entry;
        END IF;
        IF part ~ '^0[0-9]' THEN
            RAISE EXCEPTION 'malformed item id %: a number in it has a leading zero (ids are written as plain decimals)',
                quote_literal(entry) USING ERRCODE = 'RT001', DETAIL = entry;
        END IF;
        IF n <= 2 THEN
            IF length(part) > 19 OR part::numeric > 9223372036854775807 THEN
                RAISE EXCEPTION 'malformed item id %: id % is larger than 9223372036854775807', quote_literal(entry), left(part, 24)
                    USING ERRCODE = 'RT001', DETAIL = entry;
            END IF;
        ELSIF length(ltrim(part, '0')) > 4 OR coalesce(nullif(ltrim(part, '0'), ''), '0')::integer >= 8192 THEN
            RAISE EXCEPTION 'item id % is out of range: no group holds more than 8192 items', quote_literal(entry)
                USING ERRCODE = 'RT004', DETAIL = entry;
        END IF;
    END LOOP;
    s := coalesce(nullif(ltrim(start_s, '0'), ''), '0')::integer;
    e := coalesce(nullif(ltrim(end_s, '0'), ''), start_s)::integer;
    IF end_s IS NOT NULL AND e < s THEN
        RAISE EXCEPTION 'malformed item id %: run end % is before its start %', quote_literal(entry), e, s
            USING ERRCODE = 'RT001', DETAIL = entry;
    END IF;
END $$;


-- Ack item ids and runs ('<batch>:<group>:<index>', '<batch>:<group>:<start>-<end>', end inclusive),
-- as tracker.ack(): malformed entries are found first (the first one raises, naming it), then what
-- the masks will take is checked against the same bound as tracker.ids.fold (RT008 past it), then
-- the ids are folded into one mask per group and applied by ack_masks. Idempotent: an id whose bit is
-- already clear counts as a duplicate. completed: the batches this call completed.
-- The distinct items that well-formed ids and runs name (checked by outcome_ids first).
CREATE OR REPLACE FUNCTION outcome_items(ids text[])
RETURNS TABLE (b bigint, g bigint, i integer)
LANGUAGE sql IMMUTABLE SET search_path FROM CURRENT AS $$
    SELECT DISTINCT split_part(t.id, ':', 1)::bigint, split_part(t.id, ':', 2)::bigint, x.i
      FROM unnest(ids) AS t(id)
     CROSS JOIN LATERAL generate_series(split_part(split_part(t.id, ':', 3), '-', 1)::integer,
                                        coalesce(nullif(split_part(split_part(t.id, ':', 3), '-', 2), ''),
                                                 split_part(split_part(t.id, ':', 3), '-', 1))::integer) AS x(i)
$$;


-- A claim refused (ack_claim_items' validation rows: each (batch, group) named, the batch's state
-- and the group's size, NULL when missing): raise the error tracker.ack's claims raise for the same
-- ids (tracker.core.acks._claimable), which outcome_ids then words, naming the caller's entry: the
-- (batch, group) named first that is wrong, and its batch, group or range, in that order.
CREATE OR REPLACE FUNCTION outcome_claim_refusal(ids text[], vb bigint[], vg bigint[], vst text[], vsz integer[])
RETURNS void
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    bad record;
BEGIN
    SELECT e.b, e.g, e.s, e.e, v.st, v.sz INTO bad
      FROM (SELECT t.ord, min(t.ord) OVER (PARTITION BY t.b, t.g) AS group_ord, t.b, t.g, t.s, t.e
              FROM (SELECT u.ord, split_part(u.id, ':', 1)::bigint AS b, split_part(u.id, ':', 2)::bigint AS g,
                           split_part(split_part(u.id, ':', 3), '-', 1)::integer AS s,
                           coalesce(nullif(split_part(split_part(u.id, ':', 3), '-', 2), ''),
                                    split_part(split_part(u.id, ':', 3), '-', 1))::integer AS e
                      FROM unnest(ids) WITH ORDINALITY AS u(id, ord)) AS t) AS e
      JOIN unnest(vb, vg, vst, vsz) AS v(b, g, st, sz) ON v.b = e.b AND v.g = e.g
     WHERE v.st IS NULL OR v.st = 'expired' OR v.sz IS NULL OR e.e >= v.sz
     ORDER BY e.group_ord, e.ord
     LIMIT 1;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'ack_claim_items refused ids its checks accept' USING ERRCODE = 'XX000';
    END IF;
    IF bad.st IS NULL OR bad.st = 'expired' THEN
        RAISE EXCEPTION 'batch %', bad.b USING ERRCODE = CASE WHEN bad.st IS NULL THEN 'RT002' ELSE 'RT006' END,
            DETAIL = bad.b || ':' || bad.g || ':' || bad.s;
    ELSIF bad.sz IS NULL THEN
        RAISE EXCEPTION 'group %', bad.g USING ERRCODE = 'RT003', DETAIL = bad.b || ':' || bad.g || ':' || bad.s;
    END IF;
    RAISE EXCEPTION 'index' USING ERRCODE = 'RT004', DETAIL = bad.b || ':' || bad.g || ':' || greatest(bad.s, bad.sz);
END $$;


-- claims: false takes the masked path for any call (a short transaction of the caller's own
-- that wants `completed` reported: the HTTP service's requests).
DROP FUNCTION IF EXISTS outcome_ids(text[], text, text);
CREATE OR REPLACE FUNCTION outcome_ids(ids text[], completion_topic text, reason text, claims boolean DEFAULT true)
RETURNS TABLE (acked bigint, duplicates bigint, completed bigint[])
LANGUAGE plpgsql SET search_path FROM CURRENT SET jit = off AS $$
#variable_conflict use_column
DECLARE
    bad text;
    counted bigint;
    b_ids bigint[];
    g_ids bigint[];
    hexes text[];
    r record;
    ib bigint[];
    ig bigint[];
    ii integer[];
    distinct_n bigint;
    claimed_n bigint;
    refused boolean;
    vb bigint[];
    vg bigint[];
    vst text[];
    vsz integer[];
    code text;
    culprit text;
    size integer;
BEGIN
    PERFORM completion_topic_check(outcome_ids.completion_topic);
    IF outcome_ids.reason IS NOT NULL THEN
        PERFORM failure_reason_check(outcome_ids.reason);
    END IF;
    IF ids IS NULL OR coalesce(array_ndims(ids), 1) <> 1 THEN
        RAISE EXCEPTION 'ids must be a one-dimensional array of item ids' USING ERRCODE = 'RT007', DETAIL = 'ids';
    END IF;
    -- The common shapes in one pass of cheap checks; ack_entry_error explains the first misfit.
    SELECT t.id INTO bad
    FROM unnest(ids) WITH ORDINALITY t(id, ord)
    CROSS JOIN LATERAL (SELECT split_part(t.id, ':', 1) AS b, split_part(t.id, ':', 2) AS g,
                               ltrim(split_part(split_part(t.id, ':', 3), '-', 1), '0') AS s,
                               ltrim(split_part(split_part(t.id, ':', 3), '-', 2), '0') AS e) x
    WHERE t.id IS NULL OR t.id !~ '^(0|[1-9][0-9]*):(0|[1-9][0-9]*):(0|[1-9][0-9]*)(-(0|[1-9][0-9]*))?$'
       OR length(x.b) > 19 OR length(x.g) > 19
       OR (length(x.b) = 19 AND x.b::numeric > 9223372036854775807)
       OR (length(x.g) = 19 AND x.g::numeric > 9223372036854775807)
       OR length(x.s) > 4 OR length(x.e) > 4
       OR coalesce(nullif(x.s, ''), '0')::integer >= 8192 OR coalesce(nullif(x.e, ''), '0')::integer >= 8192
       OR (t.id LIKE '%-%' AND coalesce(nullif(x.e, ''), '0')::integer < coalesce(nullif(x.s, ''), '0')::integer)
    ORDER BY t.ord LIMIT 1;
    IF FOUND THEN
        PERFORM ack_entry_error(bad);
        -- ack_entry_error explains every misfit the pattern above finds; this is its backstop
        RAISE EXCEPTION 'malformed item id %: a number in it has a leading zero (ids are written as plain decimals)',
            quote_literal(bad) USING ERRCODE = 'RT001', DETAIL = bad;
    END IF;
    -- What the masks will take, before any is built, entry by entry as tracker.ids.fold counts it:
    -- a mask grows to a byte per 8 indexes up to its group's highest so far. The entry whose growth
    -- takes the total past 4 MiB (tracker.ids.MASK_BYTES_MAX: at least 4,096 whole groups) is named.
    SELECT x.id INTO bad
    FROM (SELECT y.id, y.ord, sum(y.grown) OVER (ORDER BY y.ord) AS total
          FROM (SELECT z.id, z.ord, (z.reach >> 3) - coalesce((lag(z.reach) OVER w) >> 3, -1) AS grown
                FROM (SELECT t.id, t.ord,
                             max(coalesce(nullif(split_part(split_part(t.id, ':', 3), '-', 2), ''),
                                          split_part(split_part(t.id, ':', 3), '-', 1))::integer)
                                 OVER (PARTITION BY split_part(t.id, ':', 1)::bigint, split_part(t.id, ':', 2)::bigint
                                       ORDER BY t.ord) AS reach,
                             split_part(t.id, ':', 1)::bigint AS b, split_part(t.id, ':', 2)::bigint AS g
                      FROM unnest(ids) WITH ORDINALITY t(id, ord)) z
                WINDOW w AS (PARTITION BY z.b, z.g ORDER BY z.ord)) y) x
    WHERE x.total > 4194304
    ORDER BY x.ord LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'ids: the entries up to % name more groups than one call may fold (4,194,304 bytes of masks, at least 4,096 whole groups of 8192 items); split them into several calls', quote_literal(bad)
            USING ERRCODE = 'RT008', DETAIL = bad;
    END IF;
    -- Masks without a row per index: single ids are OR-ed per byte (a row each); a run is built as a
    -- bit string of its group's length (head byte, whole 'ff' bytes, tail byte), the runs of a
    -- group OR-ed together and with the single ids' bytes, then written out 64 bits at a time.
    WITH p AS MATERIALIZED (
        SELECT t.ord, split_part(t.id, ':', 1)::bigint AS b, split_part(t.id, ':', 2)::bigint AS g,
               split_part(split_part(t.id, ':', 3), '-', 1)::integer AS s,
               coalesce(nullif(split_part(split_part(t.id, ':', 3), '-', 2), ''),
                        split_part(split_part(t.id, ':', 3), '-', 1))::integer AS e
        FROM unnest(ids) WITH ORDINALITY t(id, ord)),
    grp AS (SELECT p.b, p.g, min(p.ord) AS first_ord, sum(p.e - p.s + 1)::int8 AS n, (max(p.e) >> 3) + 1 AS nbytes
            FROM p GROUP BY p.b, p.g),
    one AS (SELECT p.b, p.g, p.s >> 3 AS k, bit_or(128 >> (p.s & 7)) AS v
            FROM p WHERE p.s = p.e GROUP BY p.b, p.g, p.s >> 3),
    gaps AS (SELECT one.b, one.g, one.k, one.v,
                    one.k - lag(one.k, 1, -1) OVER (PARTITION BY one.b, one.g ORDER BY one.k) - 1 AS zeros
             FROM one),
    ones AS (SELECT gaps.b, gaps.g,
                    string_agg(repeat('00', gaps.zeros) || lpad(to_hex(gaps.v), 2, '0'), '' ORDER BY gaps.k) AS hex
             FROM gaps GROUP BY gaps.b, gaps.g),
    runs AS (SELECT p.b, p.g,
                    bit_or(('x' || repeat('00', p.s >> 3)
                            || CASE WHEN p.s >> 3 = p.e >> 3
                                    THEN lpad(to_hex((255 >> (p.s & 7)) & (255 << (7 - (p.e & 7)))), 2, '0')
                                    ELSE lpad(to_hex(255 >> (p.s & 7)), 2, '0')
                                         || repeat('ff', (p.e >> 3) - (p.s >> 3) - 1)
                                         || lpad(to_hex((255 << (7 - (p.e & 7))) & 255), 2, '0') END
                            || repeat('00', grp.nbytes - (p.e >> 3) - 1))::varbit) AS m
             FROM p JOIN grp ON grp.b = p.b AND grp.g = p.g
             WHERE p.e > p.s GROUP BY p.b, p.g),
    hx AS (SELECT grp.b, grp.g, grp.first_ord,
                  CASE WHEN runs.m IS NULL THEN ones.hex
                       ELSE (SELECT string_agg(lpad(to_hex(substring(mm.m FROM c * 64 + 1 FOR 64)::bit(64)::int8), 16, '0'),
                                               '' ORDER BY c)
                             FROM (SELECT runs.m | ('x' || rpad(coalesce(ones.hex, ''), 2 * grp.nbytes, '0'))::varbit AS m) mm,
                                  generate_series(0, (grp.nbytes - 1) / 8) c) END AS hex
           FROM grp LEFT JOIN ones ON ones.b = grp.b AND ones.g = grp.g
                    LEFT JOIN runs ON runs.b = grp.b AND runs.g = grp.g)
    SELECT (SELECT sum(grp.n) FROM grp), array_agg(hx.b ORDER BY hx.first_ord), array_agg(hx.g ORDER BY hx.first_ord),
           array_agg(hx.hex ORDER BY hx.first_ord)
    INTO counted, b_ids, g_ids, hexes
    FROM hx;
    IF b_ids IS NULL THEN
        acked := 0; duplicates := 0; completed := '{}';
        RETURN NEXT;
        RETURN;
    END IF;
    BEGIN
        -- Decided on the items as named, repeats counted (`counted`), so that the expansion below
        -- makes at most 1,000 rows whatever the call repeats; duplicates count distinct items, as
        -- tracker.ack's claims do.
        IF outcome_ids.reason IS NULL AND outcome_ids.claims AND counted <= 1000 THEN
            SELECT sum(bit_count(('x' || h)::varbit)) INTO distinct_n FROM unnest(hexes) AS h;
            SELECT array_agg(i.b ORDER BY i.b, i.g, i.i), array_agg(i.g ORDER BY i.b, i.g, i.i),
                   array_agg(i.i ORDER BY i.b, i.g, i.i)
              INTO ib, ig, ii FROM outcome_items(ids) AS i;
            -- An ack of up to 1,000 items claims them, as tracker.ack does (R__ack_claims.sql): no
            -- batch row stays locked for the rest of the caller's transaction, so the consumers of
            -- one batch ack in parallel; bits, counts and the completion are settled at commit (or
            -- by the next settle), and `completed` stays empty. A larger ack takes the masked path.
            SELECT count(*) FILTER (WHERE c.claimed AND c.pending_bit = 1), coalesce(bool_or(c.claimed IS NULL), false),
                   array_agg(c.batch_id), array_agg(c.group_id), array_agg(c.state), array_agg(c.size)
              INTO claimed_n, refused, vb, vg, vst, vsz
              FROM ack_claim_items(ib, ig, ii, 'outbox'::regclass, outcome_ids.completion_topic) c;
            IF refused THEN  -- validation rows, one per (batch, group): nothing was claimed
                PERFORM outcome_claim_refusal(ids, vb, vg, vst, vsz);
            END IF;
            acked := claimed_n;
            duplicates := greatest(0, distinct_n - claimed_n);
            completed := '{}';
            RETURN NEXT;
            RETURN;
        END IF;
        SELECT * INTO r FROM outcome_masks(b_ids, g_ids, hexes, outcome_ids.completion_topic, outcome_ids.reason);
    EXCEPTION WHEN SQLSTATE 'RT002' OR SQLSTATE 'RT003' OR SQLSTATE 'RT004' OR SQLSTATE 'RT006' THEN
        -- Name the caller's entry as written (a run, not its first bad index), as tracker.ack does:
        -- the first entry of the batch (and group; for RT004 one reaching past the group's size).
        GET STACKED DIAGNOSTICS code = RETURNED_SQLSTATE, culprit = PG_EXCEPTION_DETAIL;
        SELECT t.id, g.size INTO bad, size
        FROM unnest(ids) WITH ORDINALITY t(id, ord)
        CROSS JOIN LATERAL string_to_array(t.id, ':') sp
        CROSS JOIN LATERAL string_to_array(culprit, ':') cp
        LEFT JOIN batch_group g ON g.batch_id = cp[1]::bigint AND g.id = cp[2]::bigint
        WHERE sp[1]::bigint = cp[1]::bigint
          AND (code IN ('RT002', 'RT006') OR sp[2]::bigint = cp[2]::bigint)
          AND (code <> 'RT004'
               OR coalesce(nullif(split_part(sp[3], '-', 2), ''), split_part(sp[3], '-', 1))::integer >= g.size)
        ORDER BY t.ord LIMIT 1;
        bad := coalesce(bad, culprit);
        CASE code
            WHEN 'RT002' THEN
                RAISE EXCEPTION 'unknown batch % (item id %)', split_part(culprit, ':', 1), quote_literal(bad)
                    USING ERRCODE = code, DETAIL = bad;
            WHEN 'RT003' THEN
                RAISE EXCEPTION 'unknown group % in batch % (item id %)', split_part(culprit, ':', 2),
                    split_part(culprit, ':', 1), quote_literal(bad) USING ERRCODE = code, DETAIL = bad;
            WHEN 'RT004' THEN
                RAISE EXCEPTION 'item id % is out of range: its group has % items (index 0..%)', quote_literal(bad),
                    size, size - 1 USING ERRCODE = code, DETAIL = bad;
            ELSE
                RAISE EXCEPTION 'batch % has expired (item id %)', split_part(culprit, ':', 1), quote_literal(bad)
                    USING ERRCODE = code, DETAIL = bad;
        END CASE;
    END;
    acked := r.acked;
    duplicates := greatest(0, counted - r.acked);
    completed := r.completed;
    RETURN NEXT;
END $$;

DROP FUNCTION IF EXISTS ack(text[], text);
CREATE OR REPLACE FUNCTION ack(ids text[], completion_topic text DEFAULT 'batch-completions', claims boolean DEFAULT true)
RETURNS TABLE (acked bigint, duplicates bigint, completed bigint[])
LANGUAGE sql SECURITY DEFINER SET search_path FROM CURRENT SET jit = off AS $$
    SELECT * FROM outcome_ids(ids, completion_topic, NULL, claims)
$$;


-- Fail item ids and runs, as ack() takes them, under one reason (1 to 500 characters): each item
-- whose bit is still set ends failed (its first terminal outcome); one already acked or failed is
-- a duplicate. completed: the batches this call finished (a threshold, or the last pending item).
CREATE OR REPLACE FUNCTION fail(ids text[], reason text, completion_topic text DEFAULT 'batch-completions')
RETURNS TABLE (failed bigint, duplicates bigint, completed bigint[])
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT SET jit = off AS $$
BEGIN
    PERFORM failure_reason_check(fail.reason);
    RETURN QUERY SELECT * FROM outcome_ids(ids, fail.completion_topic, fail.reason);
END $$;


-- The functions created again above (a new signature) get back the grants of the least-privilege
-- roles that exist (tracker.roles: producers, consumers and operators); `reaper migrate` grants
-- every function to the roles that run them all.
SELECT grant_execute_if_role_exists('producer', ARRAY[
    'open_batch(text, text, bigint, bigint, float8)', 'batch_status(bigint)', 'failures(bigint, text, integer)']);
SELECT grant_execute_if_role_exists('consumer', ARRAY[
    'batch_status(bigint)', 'failures(bigint, text, integer)', 'fail(text[], text, text)', 'ack(text[], text, boolean)',
    'fail_masks(bigint[], bigint[], text[], text, text)']);
SELECT grant_execute_if_role_exists('operator', ARRAY['batch_status(bigint)']);


-- What each function a producer or consumer calls does, for `\df+` and the documentation's SQL
-- reference (generated from these lines).
COMMENT ON FUNCTION open_batch IS 'Open a batch in the caller''s transaction and return its id. '
    'user_key: comes back in the completion event (at most 1,000 characters and 2,000 bytes in UTF-8). '
    'completion_topic: where its completion event goes (null: the default of whatever finishes it: the '
    'completion_topic argument of close_batch, ack or fail, a Python Tracker''s completion_topic, or the reaper''s '
    'harvester.default_completion_topic, each batch-completions unless set: keep them alike, or name the topic here); '
    'every topic name is one Kafka accepts (at most 249 ASCII letters, digits, ''.'', ''_'' and ''-''), and not '
    'one of its internal topics (__consumer_offsets, __transaction_state, ...), which producers may not write. '
    'parent: an open batch to nest it under (at most 8 levels). tolerated_failures, tolerated_failure_ratio: '
    'finish it early, as failed, once more of its items fail than this.';
COMMENT ON FUNCTION add_items IS 'Track `items` more items of an open batch (at most 2^30 per call): its last group '
    'is topped up, then new groups of at most 8,192 items are made. Each row returned holds items start .. upto - 1, '
    'whose ids are ''<batch_id>:<group_id>:<index>''.';
COMMENT ON FUNCTION enqueue IS 'add_items for one item per payload, and one outbox message per payload (a null '
    'payload is a tombstone) with the headers item-id and batch-id, then header_keys/header_values (one-dimensional '
    'arrays of the same length; names non-empty, not NULL, not item-id or batch-id). `key` is every '
    'message''s key unless `keys` gives one per payload (null: use `key`). Returns the group rows.';
COMMENT ON FUNCTION close_batch IS 'Close a batch: it takes no more items. Returns true when nothing is pending, '
    'in which case it finishes in this call and its completion event is written. completion_topic: for a batch '
    'opened without one.';
COMMENT ON FUNCTION batch_status IS 'A batch''s state (open, closed, complete or expired), outcome, counts, times, '
    'parent and children.';
COMMENT ON FUNCTION failures IS 'A page of at most `lim` (1 to 1000) failed items of a batch with their reasons, '
    'in item order, after the item id `after` (null: from the start).';
COMMENT ON FUNCTION ack IS 'Record items as succeeded: ids ''<batch>:<group>:<index>'' and runs '
    '''<batch>:<group>:<start>-<end>''. Idempotent: an item''s first outcome wins, later ones count as '
    'duplicates. A call naming up to 1,000 items (repeats counted) claims them (no batch row stays locked until you commit; the '
    'completion is decided at commit, so `completed` is empty); a larger call, or claims => false (for a '
    'transaction you commit at once that wants `completed`), locks the named batches'' rows until you '
    'commit and returns the batches it finished.';
COMMENT ON FUNCTION ack_masks IS 'ack for ids already folded into one mask per group (hex; item i is bit 7 - i % 8 '
    'of byte i / 8).';
COMMENT ON FUNCTION fail IS 'Record items as failed under `reason` (1 to 500 characters), as ack does for '
    'successes: the first outcome wins. Returns the items this call failed, the duplicates, and the batches it finished.';
COMMENT ON FUNCTION fail_masks IS 'fail for ids already folded into one mask per group (as ack_masks).';
