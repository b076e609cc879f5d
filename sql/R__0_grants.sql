-- A helper the other definitions call; named to sort, and so be applied, before them (definitions
-- are applied in name order, and one that has not changed keeps the helper its earlier run made).
--   grant_execute_if_role_exists(role, functions)   -> grants each function to <schema>_<role>
--
-- A function created again under a new signature loses its grants: the definition that does so
-- gives them back to the least-privilege role (tracker.roles: producer, consumer, operator) named
-- here, when that role exists, so an upgrade never leaves it without. `reaper migrate` grants every
-- function to the roles that run them all (app, reaper).


CREATE OR REPLACE FUNCTION grant_execute_if_role_exists(role_suffix text, functions text[]) RETURNS void
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    grantee text := current_schema() || '_' || role_suffix;
    fn text;
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = grantee) THEN
        FOREACH fn IN ARRAY functions LOOP
            EXECUTE format('GRANT EXECUTE ON FUNCTION %I.%s TO %I', current_schema(), fn, grantee);
        END LOOP;
    END IF;
END $$;
