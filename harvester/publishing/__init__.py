"""Publishing: mark-purge/reset from the outbox table to Kafka, under the leader's lease."""
