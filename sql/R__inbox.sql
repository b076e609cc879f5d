-- The inbox's functions (the table: 0018_inbox.sql), for the Python API (tracker.inbox) and for
-- consumers in any language, inside their own transaction:
--   inbox_claim(consumer, message_id)               -> true the first time, false for a duplicate
--   inbox_show(message_id, consumer)                -> (consumer_name, received_at, partition_name) rows
--   inbox_partitions()                              -> the partitions, their bounds, size and rows
--   inbox_add_partitions(bucket, ahead)             -> names of the partitions it made
--   inbox_drop_expired(retention, max_partitions)   -> names of the partitions it dropped
-- Errors (SQLSTATE class RT, as R__sql_api.sql): RT007 invalid argument (DETAIL: the value as
-- written), RT010 the transaction's isolation level cannot keep a claim exactly once, RT009 no
-- partition holds the current time (the maintenance has not run for longer than it keeps ahead).


CREATE OR REPLACE FUNCTION inbox_text_check(what text, value text) RETURNS void
LANGUAGE plpgsql IMMUTABLE SET search_path FROM CURRENT AS $$
BEGIN
    IF value IS NULL OR value = '' THEN
        RAISE EXCEPTION '% must be a non-empty string, got %', what, coalesce(quote_literal(value), 'null')
            USING ERRCODE = 'RT007', DETAIL = coalesce(value, 'null');
    END IF;
    IF length(value) > 200 THEN
        RAISE EXCEPTION '% % is longer than 200 characters (% characters)', what,
            quote_literal(left(value, 60) || '...'), length(value) USING ERRCODE = 'RT007', DETAIL = left(value, 60);
    END IF;
END $$;


-- Record that `consumer` processed `message_id`, in the caller's transaction: true if this call is
-- the first to record it (run the effect), false if it was recorded already (skip it).
--
-- Exactly once: the transaction advisory lock on (consumer, id) makes a concurrent claim of the
-- same id wait until this transaction ends; then (READ COMMITTED: every statement here takes a
-- new snapshot) it finds the committed id and returns false, or, if this transaction rolled back,
-- records it itself. The lookup reads every partition of the window (one index probe each); the
-- insert goes into the current one, whose unique index refuses a duplicate whatever happens.
-- Under SERIALIZABLE the lookup reads the transaction's snapshot, which cannot see a claim of the
-- same id committed after it was taken, by a transaction of any isolation level (Postgres checks
-- serializability only among SERIALIZABLE transactions), and that claim may sit in another
-- partition than this one's insert, out of its unique index's reach. So a SERIALIZABLE claim also
-- probes every other partition that may hold it: an insert of the id there, undone at once, meets
-- any such row in that partition's unique index (which sees every committed row), and Postgres
-- refuses it with a serialization failure (40001: retry the transaction), as the final insert does
-- for one in the current partition: a SERIALIZABLE claim never runs twice. REPEATABLE READ is
-- refused (RT010).
-- The advisory lock is what makes a duplicate landing in another partition (two claims whose
-- transactions straddle a bucket boundary) wait: it is held to the end of the transaction and
-- takes one entry of the shared lock table (max_locks_per_transaction x max_connections entries
-- in all), so a transaction claiming thousands of ids needs that setting raised.
CREATE OR REPLACE FUNCTION inbox_claim(consumer text, message_id text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT SET jit = off AS $$
DECLARE
    part record;
BEGIN
    PERFORM inbox_text_check('consumer', inbox_claim.consumer);
    PERFORM inbox_text_check('message_id', inbox_claim.message_id);
    IF current_setting('transaction_isolation') = 'repeatable read' THEN
        RAISE EXCEPTION 'the inbox needs READ COMMITTED or SERIALIZABLE isolation, not REPEATABLE READ'
            USING ERRCODE = 'RT010', DETAIL = 'repeatable read';
    END IF;
    -- Keyed by schema too: another schema's inbox (another unit, a test) never waits on this one.
    PERFORM pg_advisory_xact_lock(hashtext('inbox/' || current_schema()),
                                  hashtext(inbox_claim.consumer || '/' || inbox_claim.message_id));
    PERFORM FROM inbox i WHERE i.consumer = inbox_claim.consumer AND i.message_id = inbox_claim.message_id;
    IF FOUND THEN
        RETURN false;
    END IF;
    IF NOT EXISTS (SELECT FROM inbox_partition p WHERE p.lower <= now() AND now() < p.upper) THEN
        RAISE EXCEPTION 'no inbox partition holds %: run the inbox maintenance (reaper run does)', now()
            USING ERRCODE = 'RT009', DETAIL = now()::text;
    END IF;
    IF current_setting('transaction_isolation') = 'serializable' THEN
        -- Every partition whose time has begun, from the catalog as it is now (pg_partition_tree,
        -- and each partition's bounds from its constraint: not inbox_partition nor pg_class, which
        -- this transaction reads as of its snapshot and which would miss a partition attached or
        -- renamed since). A claim's row is in the partition of its transaction's start, never later
        -- than now. The current partition is probed too: harmless, the final insert would meet the
        -- same row the same way.
        FOR part IN SELECT t.relid::regclass AS rel,
                           coalesce(substring(pg_get_partition_constraintdef(t.relid)
                                              FROM $re$received_at >= '([^']*)'$re$)::timestamptz,
                                    '-infinity') AS lower
                      FROM pg_partition_tree('inbox'::regclass) t
                     WHERE t.isleaf
        LOOP
            CONTINUE WHEN part.lower > clock_timestamp();
            BEGIN
                EXECUTE format('INSERT INTO %s (consumer, message_id, received_at) VALUES ($1, $2, $3) '
                               'ON CONFLICT DO NOTHING', part.rel)
                    USING inbox_claim.consumer, inbox_claim.message_id, part.lower;
                RAISE EXCEPTION 'probe undone';  -- raise_exception (P0001): nothing the insert raises
            EXCEPTION
                WHEN raise_exception THEN NULL;  -- no such row there: the probe is undone
                WHEN undefined_table THEN NULL;   -- dropped meanwhile by the maintenance: nothing to meet
            END;
        END LOOP;
    END IF;
    INSERT INTO inbox (consumer, message_id) VALUES (inbox_claim.consumer, inbox_claim.message_id)
    ON CONFLICT DO NOTHING;
    RETURN FOUND;
END $$;


-- Where `message_id` is recorded: one row per consumer that processed it (only `consumer`'s when
-- given). Without a consumer, walks the distinct consumers through the (consumer, message_id)
-- indexes (a loose index scan), so it never reads a partition whole.
CREATE OR REPLACE FUNCTION inbox_show(message_id text, consumer text DEFAULT NULL)
RETURNS TABLE (consumer_name text, received_at timestamptz, partition_name text)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path FROM CURRENT SET jit = off AS $$
BEGIN
    PERFORM inbox_text_check('message_id', inbox_show.message_id);
    IF inbox_show.consumer IS NOT NULL THEN
        PERFORM inbox_text_check('consumer', inbox_show.consumer);
        RETURN QUERY SELECT i.consumer, i.received_at, i.tableoid::regclass::text FROM inbox i
            WHERE i.consumer = inbox_show.consumer AND i.message_id = inbox_show.message_id;
        RETURN;
    END IF;
    RETURN QUERY
    WITH RECURSIVE c(name) AS (
        SELECT min(i.consumer) FROM inbox i
        UNION ALL
        SELECT (SELECT min(i.consumer) FROM inbox i WHERE i.consumer > c.name) FROM c WHERE c.name IS NOT NULL
    )
    SELECT i.consumer, i.received_at, i.tableoid::regclass::text
      FROM c JOIN inbox i ON i.consumer = c.name AND i.message_id = inbox_show.message_id
     ORDER BY i.consumer;
END $$;


-- The partitions with their bounds; `attached` false while a concurrent detach is pending or after
-- it (until the drop); rows_estimate from the statistics (no count), bytes with its index;
-- holds_ids reads one row at most.
CREATE OR REPLACE FUNCTION inbox_partitions()
RETURNS TABLE (name text, lower timestamptz, upper timestamptz, attached boolean, rows_estimate bigint,
               bytes bigint, holds_ids boolean)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path FROM CURRENT SET jit = off AS $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT p.name, p.lower, p.upper, c.oid AS rel, c.reltuples,
                    EXISTS (SELECT FROM pg_inherits h WHERE h.inhrelid = c.oid AND h.inhparent = 'inbox'::regclass
                            AND NOT h.inhdetachpending) AS attached
               FROM inbox_partition p LEFT JOIN pg_class c ON c.oid = to_regclass(quote_ident(p.name))
              ORDER BY p.lower
    LOOP
        name := r.name; lower := r.lower; upper := r.upper; attached := r.attached;
        rows_estimate := greatest(coalesce(r.reltuples, 0), 0)::bigint;
        bytes := coalesce(pg_total_relation_size(r.rel), 0);
        holds_ids := false;
        IF r.rel IS NOT NULL THEN
            EXECUTE format('SELECT EXISTS (SELECT FROM %s)', r.rel::regclass) INTO holds_ids;
        END IF;
        RETURN NEXT;
    END LOOP;
END $$;


CREATE OR REPLACE FUNCTION inbox_interval_check(what text, value interval, low interval, high interval) RETURNS void
LANGUAGE plpgsql IMMUTABLE SET search_path FROM CURRENT AS $$
BEGIN
    IF value IS NULL OR value < low OR value > high OR extract(month FROM value) <> 0 OR extract(year FROM value) <> 0 THEN
        RAISE EXCEPTION '% must be between % and % (no months or years), got %', what, low, high, coalesce(value::text, 'null')
            USING ERRCODE = 'RT007', DETAIL = coalesce(value::text, 'null');
    END IF;
END $$;


-- Make partitions of `bucket` each until they reach `ahead` past now, starting where the last one
-- ends (or at now's bucket, when the last ends in the past). Each is created alone, indexed while
-- empty and attached (ATTACH takes SHARE UPDATE EXCLUSIVE on the inbox: claims never wait for it).
-- Several maintainers at once: the others return nothing.
CREATE OR REPLACE FUNCTION inbox_add_partitions(bucket interval, ahead interval) RETURNS SETOF text
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT SET lock_timeout = '500ms' AS $$
DECLARE
    lo timestamptz;
    n text;
BEGIN
    PERFORM inbox_interval_check('bucket', bucket, interval '1 minute', interval '31 days');
    PERFORM inbox_interval_check('ahead', ahead, interval '0', interval '366 days');
    IF extract(epoch FROM ahead) / extract(epoch FROM bucket) > 1000 THEN
        RAISE EXCEPTION 'ahead % would make more than 1000 partitions of %', ahead, bucket
            USING ERRCODE = 'RT007', DETAIL = ahead::text;
    END IF;
    -- Not a claim's key (those are 'inbox/' || schema), nor another schema's maintenance.
    IF NOT pg_try_advisory_xact_lock(hashtext('inbox-maintenance/' || current_schema()), 0) THEN
        RETURN;
    END IF;
    SELECT max(p.upper) INTO lo FROM inbox_partition p;
    lo := greatest(lo, date_bin(bucket, now(), timestamptz '2000-01-01 00:00+00'));
    WHILE lo <= now() + ahead LOOP
        n := 'inbox_p' || to_char(lo AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MI');
        EXECUTE format('CREATE TABLE %I (LIKE inbox INCLUDING DEFAULTS)', n);
        EXECUTE format('CREATE UNIQUE INDEX %I ON %I (consumer, message_id)', n || '_id', n);
        EXECUTE format('ALTER TABLE inbox ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)', n, lo, lo + bucket);
        INSERT INTO inbox_partition (name, lower, upper) VALUES (n, lo, lo + bucket);
        RETURN NEXT n;
        lo := lo + bucket;
    END LOOP;
END $$;


-- Drop up to `max_partitions` partitions whose every id is older than `retention`, oldest first,
-- each in a subtransaction: DROP TABLE takes ACCESS EXCLUSIVE on the inbox, so it waits at most
-- lock_timeout (a claim queued behind it waits no longer) and a partition it could not lock is
-- left for the next run. The reaper detaches CONCURRENTLY instead (tracker.inbox.maintain), which
-- never blocks a claim; this is the way for maintenance from SQL alone.
CREATE OR REPLACE FUNCTION inbox_drop_expired(retention interval, max_partitions integer DEFAULT 10) RETURNS SETOF text
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT SET lock_timeout = '100ms' AS $$
DECLARE
    r record;
BEGIN
    PERFORM inbox_interval_check('retention', retention, interval '1 minute', interval '3660 days');
    IF max_partitions IS NULL OR max_partitions NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION 'max_partitions must be between 1 and 1000, got %', coalesce(max_partitions::text, 'null')
            USING ERRCODE = 'RT007', DETAIL = coalesce(max_partitions::text, 'null');
    END IF;
    FOR r IN SELECT p.name FROM inbox_partition p WHERE p.upper <= now() - retention ORDER BY p.lower
             LIMIT max_partitions
    LOOP
        BEGIN
            EXECUTE format('DROP TABLE IF EXISTS %I', r.name);
            DELETE FROM inbox_partition p WHERE p.name = r.name;
            IF FOUND THEN  -- else another caller dropped it meanwhile
                RETURN NEXT r.name;
            END IF;
        EXCEPTION WHEN lock_not_available THEN
            NULL;  -- left for the next run
        END;
    END LOOP;
END $$;


-- The consumer and operator roles (tracker.roles) get these functions here too, when they exist,
-- so an upgrade never leaves them without; `reaper migrate` grants every function to app and reaper.
SELECT grant_execute_if_role_exists('consumer', ARRAY['inbox_claim(text, text)', 'inbox_show(text, text)']);
SELECT grant_execute_if_role_exists('operator', ARRAY['inbox_show(text, text)', 'inbox_partitions()']);


-- What each function consumers and operators call does, for `\df+` and the documentation's SQL
-- reference (generated from these lines).
COMMENT ON FUNCTION inbox_claim IS 'Record that `consumer` processes the message `message_id` (its message-id '
    'header) in the caller''s transaction. Returns true the first time: run the effect in the same transaction. '
    'Returns false when the id was recorded before (a redelivery, a duplicate): run nothing. A concurrent claim of '
    'the same id waits for this transaction. Refused under REPEATABLE READ; READ COMMITTED or SERIALIZABLE.';
COMMENT ON FUNCTION inbox_show IS 'Where `message_id` is recorded: one row per consumer that processed it (only '
    '`consumer`''s when given), with when it was received.';
COMMENT ON FUNCTION inbox_partitions IS 'The inbox''s time partitions with their bounds, whether they are attached, '
    'their estimated rows and bytes, and whether they still hold ids.';
