-- Completions decided by a settle of consumers' claims (0006's ack_settle) carry the batch's opening
-- span context (0008's batch.traceparent / tracestate), like those decided by a close or the acker
-- (tracker.batches.completion_insert). Same function, the two headers added.
-- Runs with search_path set to the configured schema.

CREATE OR REPLACE FUNCTION ack_settle(p_batch bigint, p_outbox regclass, p_topic text, p_wait boolean DEFAULT false,
                           OUT flipped bigint, OUT completed boolean)
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    b batch;
BEGIN
    completed := false;
    IF p_wait THEN
        PERFORM 1 FROM batch WHERE id = p_batch FOR NO KEY UPDATE;
    ELSE
        PERFORM 1 FROM batch WHERE id = p_batch FOR NO KEY UPDATE SKIP LOCKED;
    END IF;
    IF NOT FOUND THEN
        IF NOT EXISTS (SELECT 1 FROM batch WHERE id = p_batch) THEN
            DELETE FROM ack_claim WHERE batch_id = p_batch;  -- the batch was deleted (retention)
            flipped := 0;
        END IF;
        RETURN;
    END IF;
    -- A new statement: in READ COMMITTED it sees every claim committed before the lock was ours.
    WITH c AS (DELETE FROM ack_claim WHERE batch_id = p_batch RETURNING group_id, idx),
    m AS (SELECT g.id, bit_or(set_bit(g.bits # g.bits, c.idx, 1)) AS mask  -- (bits # bits: zeros, no parse)
            FROM c JOIN batch_group g ON g.batch_id = p_batch AND g.id = c.group_id AND c.idx < g.size
           GROUP BY g.id),
    f AS (SELECT m.id, m.mask, bit_count(g.bits & m.mask) AS n
            FROM m JOIN batch_group g ON g.batch_id = p_batch AND g.id = m.id),
    u AS (UPDATE batch_group g SET bits = g.bits & ~f.mask, pending = g.pending - f.n
            FROM f WHERE g.batch_id = p_batch AND g.id = f.id AND f.n > 0)
    SELECT coalesce(sum(f.n), 0) INTO flipped FROM f;
    IF flipped = 0 THEN
        RETURN;
    END IF;
    UPDATE batch SET pending = pending - flipped, last_activity_at = clock_timestamp(),
           state = CASE WHEN state = 'closed' AND pending = flipped THEN 'complete' ELSE state END,
           completed_at = CASE WHEN state = 'closed' AND pending = flipped THEN clock_timestamp()
                          ELSE completed_at END
     WHERE id = p_batch
    RETURNING * INTO b;
    IF b.state = 'complete' THEN  -- flipped > 0, so it was not complete before: this settle completed it
        completed := true;
        EXECUTE format('INSERT INTO %s (topic, key, value, header_keys, header_values) VALUES ($1, $2, $3, $4, $5)',
                       p_outbox)
          USING coalesce(b.completion_topic, p_topic), convert_to(b.id::text, 'UTF8'),
                convert_to(json_build_object('batch_id', b.id, 'user_key', b.user_key, 'total', b.total,
                           'opened_at', b.created_at, 'closed_at', b.closed_at,
                           'completed_at', b.completed_at)::text, 'UTF8'),
                ARRAY['batch-id']
                  || CASE WHEN b.traceparent IS NULL THEN '{}'::text[] ELSE ARRAY['traceparent'] END
                  || CASE WHEN b.tracestate IS NULL THEN '{}'::text[] ELSE ARRAY['tracestate'] END,
                ARRAY[convert_to(b.id::text, 'UTF8')]
                  || CASE WHEN b.traceparent IS NULL THEN '{}'::bytea[] ELSE ARRAY[convert_to(b.traceparent, 'UTF8')] END
                  || CASE WHEN b.tracestate IS NULL THEN '{}'::bytea[] ELSE ARRAY[convert_to(b.tracestate, 'UTF8')] END;
    END IF;
END
$$;
