-- A consumer's claim (tracker.acks.claim_op) in one statement: validate, claim, read the bits.
--
-- Before, the claim path sent five statements (states, sizes, claim, read, freshness check),
-- unprepared because they went through a pipeline, and most of a single-id ack's cost on both
-- sides was parsing, planning and exchanging them. This function runs the same statements with
-- PL/pgSQL's cached plans, in the same order and with the same snapshots:
--   1. validation: every named batch exists and is not expired, every group exists, every index
--      is below its group's size. If anything is wrong, NOTHING is claimed and the function
--      returns one row per (batch, group) named, with the batch's state and the group's size
--      (NULL when missing), and `claimed` NULL: the caller raises the typed error naming the id.
--   2. the claim (one row per item; the primary key is the per-item exclusion, waited on when a
--      concurrent transaction holds the same item) and its commit-time settle request;
--   3. a new statement (READ COMMITTED: a snapshot taken after the claim's waits) reads each
--      item's bit, returned with whether this call's claim of it is new;
--   4. ack_fresh_check (REPEATABLE READ / SERIALIZABLE: a serialization failure rather than a
--      stale "still pending"; a no-op in READ COMMITTED).
-- Runs with search_path set to the configured schema.

CREATE FUNCTION ack_claim_items(p_batch bigint[], p_group bigint[], p_idx integer[], p_outbox regclass, p_topic text)
RETURNS TABLE (batch_id bigint, group_id bigint, idx integer, state text, size integer, claimed boolean, pending_bit integer)
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
    bad boolean;
    vb bigint[];
    vg bigint[];
    vst text[];
    vsz integer[];
    cb bigint[];
    cg bigint[];
    ci integer[];
BEGIN
    -- One statement, so the error rows are the very rows the decision saw. A NULL or negative
    -- index is refused too (tracker's callers never send one).
    SELECT coalesce(bool_or(v.st IS NULL OR v.st = 'expired' OR v.sz IS NULL OR v.top >= v.sz
                            OR v.low < 0 OR v.nulls > 0), false),
           array_agg(v.b), array_agg(v.g), array_agg(v.st), array_agg(v.sz)
      INTO bad, vb, vg, vst, vsz
      FROM (SELECT u.b, u.g, max(u.i) AS top, min(u.i) AS low, count(*) - count(u.i) AS nulls,
                   min(b.state) AS st, min(g.size) AS sz
              FROM unnest(p_batch, p_group, p_idx) AS u(b, g, i)
              LEFT JOIN batch b ON b.id = u.b
              LEFT JOIN batch_group g ON g.batch_id = u.b AND g.id = u.g
             GROUP BY u.b, u.g) AS v;
    IF bad THEN
        RETURN QUERY SELECT e.b, e.g, NULL::integer, e.st, e.sz, NULL::boolean, NULL::integer
                       FROM unnest(vb, vg, vst, vsz) AS e(b, g, st, sz);
        RETURN;
    END IF;
    -- In (batch, group, index) order, so two calls claiming overlapping items cannot deadlock.
    WITH c AS (INSERT INTO ack_claim (batch_id, group_id, idx)
               SELECT * FROM unnest(p_batch, p_group, p_idx) ORDER BY 1, 2, 3
               ON CONFLICT DO NOTHING RETURNING batch_id, group_id, idx),
         r AS (INSERT INTO ack_settle_request (batch_id, outbox, topic)
               SELECT DISTINCT c.batch_id, p_outbox, p_topic FROM c ON CONFLICT DO NOTHING)
    SELECT array_agg(c.batch_id), array_agg(c.group_id), array_agg(c.idx) INTO cb, cg, ci FROM c;
    RETURN QUERY
        SELECT u.b, u.g, u.i, NULL::text, NULL::integer,
               coalesce((u.b, u.g, u.i) IN (SELECT * FROM unnest(cb, cg, ci)), false),
               CASE WHEN u.i < g.size THEN get_bit(g.bits, u.i) END
          FROM unnest(p_batch, p_group, p_idx) AS u(b, g, i)
          JOIN batch_group g ON g.batch_id = u.b AND g.id = u.g;
    PERFORM ack_fresh_check(array_agg(d.b), array_agg(d.g))
       FROM (SELECT DISTINCT u.b, u.g FROM unnest(p_batch, p_group) AS u(b, g)) AS d;
END
$$;
