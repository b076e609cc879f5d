-- The operator's kit (issue 15): trace context of a batch's opening span, and an audit log of
-- what operators did with `reaper dead requeue` and `reaper batch expire`.

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
