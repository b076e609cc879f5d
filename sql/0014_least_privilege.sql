-- SQL callers get functions, not tables. The functions a producer or a consumer calls run as their
-- owner (SECURITY DEFINER; their search_path is pinned to this schema, pg_catalog and pg_temp by
-- 0012), so a caller needs EXECUTE on them and no privilege on batch, batch_group or outbox: it
-- cannot corrupt the bits and counts the guarantees rest on. No function is executable by PUBLIC
-- any more (`reaper migrate` revokes it again after every run, since each new function gets it):
-- `reaper migrate --roles print|create` grants each role exactly what it needs (tracker/roles.py).
-- A later migration that replaces one of these functions must say SECURITY DEFINER again
-- (tests/test_roles.py checks both).
-- Runs with search_path set to the configured schema.

DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
             WHERE p.pronamespace = current_schema()::regnamespace
               AND p.proname IN ('open_batch', 'add_items', 'enqueue', 'close_batch', 'batch_status', 'ack', 'ack_masks')
    LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER', f);
    END LOOP;
    EXECUTE format('REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA %I FROM PUBLIC', current_schema());
END $$;

