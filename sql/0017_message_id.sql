-- The namespace of each outbox table's message ids. The harvester publishes every row with a
-- `message-id` header `<namespace>:<row id>` (tracker.message_ids): row ids are never reused within
-- a table, and the namespace is a random UUID stored here once, so the id names the row across
-- databases and tables and is the same on every republication. It lives in a row, not in the
-- outbox: no column is added (no table rewrite, no work per row), and like any row it is replicated
-- to a standby and kept by a backup, so a promoted standby or a restore publishes the same ids.
-- Keyed by regclass: a dump writes it as the table's name and a restore resolves it again; a table
-- dropped and created anew (its ids start again) gets a new namespace. Tables not created by these
-- migrations get theirs when the harvester first reads it.
CREATE TABLE outbox_namespace (
    outbox     regclass    PRIMARY KEY,
    namespace  uuid        NOT NULL UNIQUE DEFAULT gen_random_uuid(),
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

INSERT INTO outbox_namespace (outbox) VALUES ('outbox'::regclass);
