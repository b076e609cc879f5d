-- The tenant whose HTTP token opened a batch (http.tenants_file); null for batches opened by the
-- Python API or SQL, which the HTTP service's `default` tenant sees. Never changes once set.
-- Runs with search_path set to the configured schema.

ALTER TABLE batch ADD COLUMN tenant text;
