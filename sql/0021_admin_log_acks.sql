-- `reaper acks requeue` (and the console's requeue of dead-lettered acks) records itself in
-- admin_log as 'acks-requeue': the messages it sent back to the ack topic, by where they were in
-- the dead-letter topic.
ALTER TABLE admin_log DROP CONSTRAINT admin_log_action_check;
ALTER TABLE admin_log ADD CONSTRAINT admin_log_action_check
    CHECK (action IN ('dead-requeue', 'batch-expire', 'acks-requeue'));
