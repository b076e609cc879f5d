-- Message ids that never come again: from this version on, the harvester names a row by its
-- namespace, its id and its `created_at` (`<namespace>:<row id>:<created_at in microseconds since
-- the Unix epoch>`, tracker.message_ids), so a row id used again after its sequence went back
-- (TRUNCATE ... RESTART IDENTITY, setval, an older backup restored, a standby promoted without
-- the last commits) is a new message id: its row was created later.
--
-- Rows created before `suffix_from` keep the id of the previous versions, `<namespace>:<row id>`,
-- every time they are published: one the previous version published is the same message when this
-- version publishes it again. A namespace that exists now gets this migration's time; one
-- registered later gets -infinity (every row the new form). Only this small table changes: no
-- outbox is rewritten. `reaper run` applies this file itself (under the migration lock), after
-- 0017, in an outbox's schema that has no namespace table or one without this column.
ALTER TABLE outbox_namespace ADD COLUMN IF NOT EXISTS suffix_from timestamptz;
UPDATE outbox_namespace SET suffix_from = clock_timestamp() WHERE suffix_from IS NULL;
ALTER TABLE outbox_namespace ALTER COLUMN suffix_from SET DEFAULT '-infinity';
ALTER TABLE outbox_namespace ALTER COLUMN suffix_from SET NOT NULL;
