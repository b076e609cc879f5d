-- The namespace of each outbox table's message ids. The harvester publishes every row with a
-- `message-id` header `<namespace>:<row id>` (tracker.message_ids): row ids are never reused within
-- a table, and the namespace is a random UUID stored here once, so the id names the row across
-- databases and tables and is the same on every republication. It lives in a row, not in the
-- outbox: no column is added (no table rewrite, no work per row), and like any row it is replicated
-- to a standby and kept by a backup, so a promoted standby or a restore publishes the same ids.
-- Keyed by regclass: a dump writes it as the table's name and a restore resolves it again; a table
-- dropped and created anew (its ids start again) gets a new namespace. Tables not created by these
-- migrations get theirs when the harvester first reads it; `reaper run` creates this table itself
-- (this file, under the migration lock) in an outbox's schema that has none.
CREATE TABLE IF NOT EXISTS outbox_namespace (
    outbox     regclass    PRIMARY KEY,
    namespace  uuid        NOT NULL UNIQUE DEFAULT gen_random_uuid(),
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- This schema's own outbox, when it has one (a schema the reaper creates the table in may not).
INSERT INTO outbox_namespace (outbox)
SELECT c.oid::regclass FROM pg_class c
WHERE c.relname = 'outbox' AND c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
ON CONFLICT (outbox) DO NOTHING;

-- Roles granted before this table existed (`reaper migrate --roles`, tracker.roles) get what they
-- would be granted now (in its order): the operator reads namespaces, the reaper reads and registers them.
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = current_schema() || '_operator') THEN
        EXECUTE format('GRANT SELECT ON outbox_namespace TO %I', current_schema() || '_operator');
    END IF;
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = current_schema() || '_reaper') THEN
        EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_namespace TO %I', current_schema() || '_reaper');
    END IF;
END $$;
