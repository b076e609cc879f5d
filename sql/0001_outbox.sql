-- The transactional outbox. Applications insert rows in their own transaction; the harvester
-- publishes committed rows and deletes them once Kafka has acknowledged them.
-- Runs with search_path set to the configured schema.
CREATE TABLE outbox (
    id            bigserial   PRIMARY KEY,
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    topic         text        NOT NULL CHECK (topic <> ''),
    key           bytea,                       -- null: no key
    value         bytea,                       -- null: tombstone
    header_keys   text[]      NOT NULL DEFAULT '{}',
    header_values bytea[]     NOT NULL DEFAULT '{}',
    kafka_partition integer   CHECK (kafka_partition >= 0),  -- null: the producer's partitioner decides
    leader_id     uuid,                        -- null: not in flight
    CONSTRAINT outbox_headers_paired CHECK (cardinality(header_keys) = cardinality(header_values))
) WITH (
    -- Room on each page for the harvester's mark (an UPDATE of leader_id) to stay a HOT update:
    -- no new index entry per mark, and the old version is pruned within the page.
    fillfactor = 50,
    -- The harvester deletes from the head all day; vacuum must keep up by rows, not by fraction.
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 100000,
    autovacuum_vacuum_cost_delay = 0
);

-- Rows Kafka can never accept (too large for message.max.bytes, an explicit partition that does not
-- exist, an invalid topic name). The leader moves such a row here atomically, in one statement,
-- so it cannot block every row behind it; an operator inspects, fixes and re-inserts it if wanted.
CREATE TABLE outbox_dead (
    id            bigint      PRIMARY KEY,     -- the outbox id it had
    created_at    timestamptz NOT NULL,
    topic         text        NOT NULL,
    key           bytea,
    value         bytea,
    header_keys   text[]      NOT NULL,
    header_values bytea[]     NOT NULL,
    kafka_partition integer,
    leader_id     uuid,                        -- the leader id that quarantined it
    failed_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    reason        text        NOT NULL
);
