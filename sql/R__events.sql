-- The events a batch announces, each defined here once. Every path that completes a batch (a close,
-- the Python API's acks, the acker's and Spark's masks, a settle of consumers' claims, the SQL
-- functions close_batch, ack and ack_masks, the HTTP service through either backend) inserts into
-- the outbox what completion_event returns, and the sweeper's and the operator's expiry what
-- expiry_event returns, so payload and headers cannot differ between paths:
--   INSERT INTO outbox (topic, key, value, header_keys, header_values)
--   SELECT e.* FROM finished f CROSS JOIN LATERAL completion_event(f.whole, <default topic>) e
-- where `whole` is the batch row as the completing statement left it.
--
-- Every event: key = the batch id; headers `batch-id`, then the event's own, then the W3C trace
-- context of the span that opened the batch (`traceparent`, `tracestate`, tracker.tracing) when it
-- had one.
--
-- The planner inlines these functions into the statement that calls them from FROM, so an event
-- costs what its expressions cost and no function call: that takes LANGUAGE sql, STABLE, not
-- STRICT, not SECURITY DEFINER, RETURNS SETOF (one row all the same) and no SET clause. Their
-- names cannot follow the caller's search_path nonetheless: the SQL-standard bodies (BEGIN ATOMIC)
-- are bound when created, under the schema's path. The price of that binding: the functions
-- depend on the batch columns they read, so a versioned migration cannot drop or retype one of
-- those columns while they exist (it drops them and deletes this file's row in
-- schema_definitions; the same migrate run then defines them again).

-- They used to return one row and not a set, which CREATE OR REPLACE cannot change: that shape is
-- dropped here, in the transaction that defines them again, so no caller ever finds them missing.
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOREACH f IN ARRAY ARRAY[to_regprocedure('completion_event(batch, text)'),
                             to_regprocedure('expiry_event(batch, text, text, jsonb)'),
                             to_regprocedure('batch_event(batch, text, text, text[], bytea[])')] LOOP
        IF f IS NOT NULL AND NOT (SELECT p.proretset FROM pg_proc p WHERE p.oid = f) THEN
            EXECUTE format('DROP FUNCTION %s', f);
        END IF;
    END LOOP;
END $$;

CREATE OR REPLACE FUNCTION batch_event(b batch, to_topic text, body text, event_keys text[], event_values bytea[],
                                       OUT topic text, OUT key bytea, OUT value bytea,
                                       OUT header_keys text[], OUT header_values bytea[])
RETURNS SETOF record LANGUAGE sql STABLE
BEGIN ATOMIC
    SELECT to_topic, convert_to(b.id::text, 'UTF8'), convert_to(body, 'UTF8'),
           ARRAY['batch-id'] || event_keys
               || CASE WHEN b.traceparent IS NULL THEN '{}'::text[] ELSE ARRAY['traceparent'] END
               || CASE WHEN b.tracestate IS NULL THEN '{}'::text[] ELSE ARRAY['tracestate'] END,
           ARRAY[convert_to(b.id::text, 'UTF8')] || event_values
               || CASE WHEN b.traceparent IS NULL THEN '{}'::bytea[] ELSE ARRAY[convert_to(b.traceparent, 'UTF8')] END
               || CASE WHEN b.tracestate IS NULL THEN '{}'::bytea[] ELSE ARRAY[convert_to(b.tracestate, 'UTF8')] END;
END;


-- The completion event of a batch that has just finished: to its own completion topic, else
-- `default_topic`. Value (schema_version 2; the version 1 keys batch_id, user_key, total, opened_at,
-- closed_at, completed_at unchanged): "event": "batch.completed", "outcome" ("succeeded", or
-- "failed" when an item or a child failed or a threshold finished it early), its own items'
-- "succeeded", "failed" and "pending" (non-zero only for an early finish), "parent_id",
-- "children" {"total", "failed"} and "rollup" {"total", "succeeded", "failed"}: its items and
-- those of every descendant that finished before it, items still pending (an early finish) counted
-- as failed, so rollup succeeded + failed = total. The roll-up is exactly what the batch adds to its
-- parent's (batch_finish, sql/R__outcomes.sql); a descendant finishing after it is not counted. Headers unchanged (no `event` header: an expiry event has one).
CREATE OR REPLACE FUNCTION completion_event(b batch, default_topic text,
                                            OUT topic text, OUT key bytea, OUT value bytea,
                                            OUT header_keys text[], OUT header_values bytea[])
RETURNS SETOF record LANGUAGE sql STABLE
BEGIN ATOMIC
    SELECT * FROM batch_event(
        b, coalesce(b.completion_topic, default_topic),
        json_build_object('batch_id', b.id, 'user_key', b.user_key, 'total', b.total,
                          'opened_at', b.created_at, 'closed_at', b.closed_at, 'completed_at', b.completed_at,
                          'event', 'batch.completed', 'schema_version', 2, 'outcome', b.outcome, 'succeeded', b.total - b.pending - b.failed,
                          'failed', b.failed, 'pending', b.pending, 'parent_id', b.parent_id,
                          'children', json_build_object('total', b.children, 'failed', b.children_failed),
                          'rollup', json_build_object(
                              'total', b.total + b.rollup_total,
                              'succeeded', b.total - b.pending - b.failed + b.rollup_total - b.rollup_failed,
                              'failed', b.pending + b.failed + b.rollup_failed))::text,
        '{}', '{}');
END;


-- The expiry event of a batch that has just expired (tracker.expiry), to `to_topic`. Value
-- (schema_version 2, the envelope of the completion event): "event": "expired" (as in version 1), "outcome":
-- "expired", the counts at expiry ("rollup" as the completion event's: items pending at expiry
-- count as failed, which is what the parent counts for it; its version 1 keys pending, acked, state, reason,
-- last_activity_at, expired_at unchanged, "acked" counting succeeded and failed items), the
-- keys of `detail`; the header `event` says batch-expired (tracker.expiry.EXPIRY_EVENT).
CREATE OR REPLACE FUNCTION expiry_event(b batch, to_topic text, reason text, detail jsonb,
                                        OUT topic text, OUT key bytea, OUT value bytea,
                                        OUT header_keys text[], OUT header_values bytea[])
RETURNS SETOF record LANGUAGE sql STABLE
BEGIN ATOMIC
    SELECT * FROM batch_event(
        b, to_topic,
        (jsonb_build_object(
            'event', 'expired', 'schema_version', 2, 'outcome', 'expired',
            'batch_id', b.id, 'user_key', b.user_key, 'total', b.total,
            'pending', b.pending, 'acked', b.total - b.pending, 'reason', reason,
            'succeeded', b.total - b.pending - b.failed, 'failed', b.failed, 'parent_id', b.parent_id,
            'children', jsonb_build_object('total', b.children, 'failed', b.children_failed),
            'rollup', jsonb_build_object(
                'total', b.total + b.rollup_total,
                'succeeded', b.total - b.pending - b.failed + b.rollup_total - b.rollup_failed,
                'failed', b.pending + b.failed + b.rollup_failed),
            'state', CASE WHEN b.closed_at IS NULL THEN 'open' ELSE 'closed' END,
            'opened_at', b.created_at, 'closed_at', b.closed_at, 'last_activity_at', b.last_activity_at,
            'expired_at', b.expired_at) || coalesce(detail, '{}'))::text,
        ARRAY['event'], ARRAY[convert_to('batch-expired', 'UTF8')]);
END;
