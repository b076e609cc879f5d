-- Batches by user key, newest first: the console's search finds a batch by the key an application
-- gave it, however old, by this index rather than by reading the newest batches. One entry per
-- batch that has a key (a batch, not an item: one index insert per open_batch); batches without a
-- key are not in it.
CREATE INDEX IF NOT EXISTS batch_user_key ON batch (user_key, id) WHERE user_key IS NOT NULL;
