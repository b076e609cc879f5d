-- The rows written before 0024 that break its constraints could never be published as written:
-- they go to the dead table with the reason, in one statement (a row is always in exactly one of
-- the two tables), as the harvester would move them. Then the constraints are validated: VALIDATE
-- CONSTRAINT takes a SHARE UPDATE EXCLUSIVE lock, so inserts, marks and purges go on meanwhile.
WITH gone AS (
    DELETE FROM outbox
     WHERE array_ndims(header_keys) > 1 OR array_ndims(header_values) > 1
        OR (CASE WHEN array_ndims(header_keys) > 1 THEN false ELSE array_position(header_keys, NULL) IS NOT NULL END)
    RETURNING id, created_at, topic, key, value, header_keys, header_values, kafka_partition, leader_id
)
INSERT INTO outbox_dead (id, created_at, topic, key, value, header_keys, header_values, kafka_partition, leader_id,
                         reason)
SELECT id, created_at, topic, key, value, header_keys, header_values, kafka_partition, leader_id,
       'moved aside by reaper migrate: ' || CASE
           WHEN array_ndims(header_keys) > 1 THEN 'header_keys is not a one-dimensional array'
           WHEN array_ndims(header_values) > 1 THEN 'header_values is not a one-dimensional array'
           ELSE 'a header name is NULL' END
FROM gone;

ALTER TABLE outbox VALIDATE CONSTRAINT outbox_header_keys_flat;
ALTER TABLE outbox VALIDATE CONSTRAINT outbox_header_values_flat;
ALTER TABLE outbox VALIDATE CONSTRAINT outbox_header_names_not_null;
