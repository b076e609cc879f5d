-- Kafka headers are a flat list of (name, value) pairs, each name text. The table's first CHECK
-- compares the arrays' cardinalities only, so a two-dimensional array, or a NULL name, could be
-- written, and then not be published as written (the harvester moves such a row to the dead
-- table, harvester/publishing/unfit_rows.py). From here on the table refuses them.
--
-- Added NOT VALID: the ALTER holds the table's ACCESS EXCLUSIVE lock only for the catalog change,
-- never for a scan of the rows. Rows written from here on are checked; 0025 moves aside the rows
-- written before that break them, and validates the constraints under a lock that lets
-- applications write and the harvester publish meanwhile.
ALTER TABLE outbox
    ADD CONSTRAINT outbox_header_keys_flat CHECK (array_ndims(header_keys) <= 1) NOT VALID,
    ADD CONSTRAINT outbox_header_values_flat CHECK (array_ndims(header_values) <= 1) NOT VALID,
    -- (array_position cannot search an array of more than one dimension: outbox_header_keys_flat's case)
    ADD CONSTRAINT outbox_header_names_not_null
        CHECK (CASE WHEN array_ndims(header_keys) > 1 THEN true ELSE array_position(header_keys, NULL) IS NULL END)
        NOT VALID;
