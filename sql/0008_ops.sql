-- The operator's kit: trace context of a batch's opening span, and an audit log of
-- what operators did with `reaper dead requeue` and `reaper batch expire`.
-- Only comments changed since this file was first applied; the checksum it had then:
-- replaces 0008_ops.sql sha256:068bca96d42d02d63d9e2f97fb94b7f42b2d96c26a89882a0f373a202848cf9c

-- W3C trace context of the span that opened the batch (null: none was active). The batch's
-- completion and expiry events carry it as `traceparent`/`tracestate` headers. Nullable columns
-- without a default: adding them rewrites nothing, and no index names them (acks stay HOT).
ALTER TABLE batch ADD COLUMN traceparent text, ADD COLUMN tracestate text;

-- One row per committed admin action (a requeue commits chunk by chunk: one row per chunk),
-- written in the same transaction as the action itself. `reaper run` exports the requeued total
-- as a gauge, so requeues show on the dashboard although the CLI is never scraped.
CREATE TABLE admin_log (
    id      bigserial   PRIMARY KEY,
    at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    action  text        NOT NULL CHECK (action IN ('dead-requeue', 'batch-expire')),
    rows    bigint      NOT NULL CHECK (rows >= 0),
    detail  jsonb       NOT NULL DEFAULT '{}'
);
CREATE INDEX admin_log_action ON admin_log (action);
