-- The inbox: the message ids each consumer has processed, recorded in the consumer's own
-- transaction with its effect (tracker.inbox, inbox_claim in R__inbox.sql), kept for a retention
-- window and then dropped a whole partition at a time: no DELETE ever runs on it.
-- Runs with search_path set to the configured schema.
--
-- Partitioned by the time an id was received. A unique index of a partitioned table must hold its
-- partition key, so uniqueness across the window is not an index's: each partition has its own
-- unique (consumer, message_id) index, and a claim takes a transaction advisory lock on the id,
-- looks it up in every partition, and inserts it into the current one only when absent
-- (R__inbox.sql says why that is exactly once). The per-partition index also refuses a duplicate
-- inside one partition, whatever happens.
CREATE TABLE inbox (
    consumer    text        NOT NULL,
    message_id  text        NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now()
) PARTITION BY RANGE (received_at);

-- The partitions the inbox has, with their bounds (read by claims to name a missing partition, by
-- the maintenance to find expired ones, and by `reaper inbox status`). Written in the transaction
-- that attaches a partition, deleted in the one that drops it.
CREATE TABLE inbox_partition (
    name       text        PRIMARY KEY,
    lower      timestamptz NOT NULL,
    upper      timestamptz NOT NULL CHECK (upper > lower)
);

-- Today's partition and the next three (UTC days), so claims work before the first maintenance;
-- the maintenance (tracker.inbox.maintain, run by `reaper run`) keeps partitions ahead of time
-- and drops expired ones at the configured bucket and retention.
DO $$
DECLARE
    d timestamptz := date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC';
    n text;
BEGIN
    FOR i IN 0..3 LOOP
        n := 'inbox_p' || to_char((d + i * interval '1 day') AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MI');
        EXECUTE format('CREATE TABLE %I (LIKE inbox INCLUDING DEFAULTS)', n);
        EXECUTE format('CREATE UNIQUE INDEX %I ON %I (consumer, message_id)', n || '_id', n);
        EXECUTE format('ALTER TABLE inbox ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)', n,
                       d + i * interval '1 day', d + (i + 1) * interval '1 day');
        INSERT INTO inbox_partition (name, lower, upper) VALUES (n, d + i * interval '1 day', d + (i + 1) * interval '1 day');
    END LOOP;
END $$;
