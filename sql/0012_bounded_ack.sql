-- The SQL ack's cost bounded by what the caller sent. 0007's ack() expanded every run into a row
-- per index (generate_series), so one 12-byte run cost 8,192 rows and 100,000 of them ~819 million.
-- Here a run costs one bit string of at most 1 KiB, a single id one row, and the masks' total size
-- is checked before any is built: at most 4 MiB (tracker.ids.MASK_BYTES_MAX), else RT008 naming the
-- entry. Same signature, same errors otherwise, same results.
-- Runs with search_path set to the configured schema.

-- Ack item ids and runs ('<batch>:<group>:<index>', '<batch>:<group>:<start>-<end>', end inclusive),
-- as tracker.ack(): malformed entries are found first (the first one raises, naming it), then what
-- the masks will take is checked against the same bound as tracker.ids.fold (RT008 past it), then
-- the ids are folded into one mask per group and applied by ack_masks. Idempotent: an id whose bit is
-- already clear counts as a duplicate. completed: the batches this call completed.
CREATE OR REPLACE FUNCTION ack(ids text[], completion_topic text DEFAULT 'batch-completions')
RETURNS TABLE (acked bigint, duplicates bigint, completed bigint[])
LANGUAGE plpgsql SET search_path FROM CURRENT SET jit = off AS $$
#variable_conflict use_column
DECLARE
    bad text;
    counted bigint;
    b_ids bigint[];
    g_ids bigint[];
    hexes text[];
    r record;
    code text;
    culprit text;
    size integer;
BEGIN
    IF ids IS NULL OR coalesce(array_ndims(ids), 1) <> 1 THEN
        RAISE EXCEPTION 'ids must be a one-dimensional array of item ids' USING ERRCODE = 'RT007', DETAIL = 'ids';
    END IF;
    -- The common shapes in one pass of cheap checks; ack_entry_error explains the first misfit.
    SELECT t.id INTO bad
    FROM unnest(ids) WITH ORDINALITY t(id, ord)
    CROSS JOIN LATERAL (SELECT split_part(t.id, ':', 1) AS b, split_part(t.id, ':', 2) AS g,
                               ltrim(split_part(split_part(t.id, ':', 3), '-', 1), '0') AS s,
                               ltrim(split_part(split_part(t.id, ':', 3), '-', 2), '0') AS e) x
    WHERE t.id IS NULL OR t.id !~ '^[0-9]+:[0-9]+:[0-9]+(-[0-9]+)?$'
       OR length(x.b) > 19 OR length(x.g) > 19
       OR (length(x.b) = 19 AND x.b::numeric > 9223372036854775807)
       OR (length(x.g) = 19 AND x.g::numeric > 9223372036854775807)
       OR length(x.s) > 4 OR length(x.e) > 4
       OR coalesce(nullif(x.s, ''), '0')::integer >= 8192 OR coalesce(nullif(x.e, ''), '0')::integer >= 8192
       OR (t.id LIKE '%-%' AND coalesce(nullif(x.e, ''), '0')::integer < coalesce(nullif(x.s, ''), '0')::integer)
    ORDER BY t.ord LIMIT 1;
    IF FOUND THEN
        PERFORM ack_entry_error(bad);
        -- (ack_entry_error raises; this is only reached if the two checks ever disagree)
        RAISE EXCEPTION 'malformed item id %', quote_literal(bad) USING ERRCODE = 'RT001', DETAIL = bad;
    END IF;
    -- What the masks will take, before any is built, entry by entry as tracker.ids.fold counts it:
    -- a mask grows to a byte per 8 indexes up to its group's highest so far. The entry whose growth
    -- takes the total past 4 MiB (tracker.ids.MASK_BYTES_MAX: at least 4,096 whole groups) is named.
    SELECT x.id INTO bad
    FROM (SELECT y.id, y.ord, sum(y.grown) OVER (ORDER BY y.ord) AS total
          FROM (SELECT z.id, z.ord, (z.reach >> 3) - coalesce((lag(z.reach) OVER w) >> 3, -1) AS grown
                FROM (SELECT t.id, t.ord,
                             max(coalesce(nullif(split_part(split_part(t.id, ':', 3), '-', 2), ''),
                                          split_part(split_part(t.id, ':', 3), '-', 1))::integer)
                                 OVER (PARTITION BY split_part(t.id, ':', 1)::bigint, split_part(t.id, ':', 2)::bigint
                                       ORDER BY t.ord) AS reach,
                             split_part(t.id, ':', 1)::bigint AS b, split_part(t.id, ':', 2)::bigint AS g
                      FROM unnest(ids) WITH ORDINALITY t(id, ord)) z
                WINDOW w AS (PARTITION BY z.b, z.g ORDER BY z.ord)) y) x
    WHERE x.total > 4194304
    ORDER BY x.ord LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'ids: the entries up to % name more groups than one call may fold (4,194,304 bytes of masks, at least 4,096 whole groups of 8192 items); split them into several calls', quote_literal(bad)
            USING ERRCODE = 'RT008', DETAIL = bad;
    END IF;
    -- Masks without a row per index: single ids are OR-ed per byte (a row each); a run is built as a
    -- bit string of its group's length (head byte, whole 'ff' bytes, tail byte), the runs of a
    -- group OR-ed together and with the single ids' bytes, then written out 64 bits at a time.
    WITH p AS MATERIALIZED (
        SELECT t.ord, split_part(t.id, ':', 1)::bigint AS b, split_part(t.id, ':', 2)::bigint AS g,
               split_part(split_part(t.id, ':', 3), '-', 1)::integer AS s,
               coalesce(nullif(split_part(split_part(t.id, ':', 3), '-', 2), ''),
                        split_part(split_part(t.id, ':', 3), '-', 1))::integer AS e
        FROM unnest(ids) WITH ORDINALITY t(id, ord)),
    grp AS (SELECT p.b, p.g, min(p.ord) AS first_ord, sum(p.e - p.s + 1)::int8 AS n, (max(p.e) >> 3) + 1 AS nbytes
            FROM p GROUP BY p.b, p.g),
    one AS (SELECT p.b, p.g, p.s >> 3 AS k, bit_or(128 >> (p.s & 7)) AS v
            FROM p WHERE p.s = p.e GROUP BY p.b, p.g, p.s >> 3),
    gaps AS (SELECT one.b, one.g, one.k, one.v,
                    one.k - lag(one.k, 1, -1) OVER (PARTITION BY one.b, one.g ORDER BY one.k) - 1 AS zeros
             FROM one),
    ones AS (SELECT gaps.b, gaps.g,
                    string_agg(repeat('00', gaps.zeros) || lpad(to_hex(gaps.v), 2, '0'), '' ORDER BY gaps.k) AS hex
             FROM gaps GROUP BY gaps.b, gaps.g),
    runs AS (SELECT p.b, p.g,
                    bit_or(('x' || repeat('00', p.s >> 3)
                            || CASE WHEN p.s >> 3 = p.e >> 3
                                    THEN lpad(to_hex((255 >> (p.s & 7)) & (255 << (7 - (p.e & 7)))), 2, '0')
                                    ELSE lpad(to_hex(255 >> (p.s & 7)), 2, '0')
                                         || repeat('ff', (p.e >> 3) - (p.s >> 3) - 1)
                                         || lpad(to_hex((255 << (7 - (p.e & 7))) & 255), 2, '0') END
                            || repeat('00', grp.nbytes - (p.e >> 3) - 1))::varbit) AS m
             FROM p JOIN grp ON grp.b = p.b AND grp.g = p.g
             WHERE p.e > p.s GROUP BY p.b, p.g),
    hx AS (SELECT grp.b, grp.g, grp.first_ord,
                  CASE WHEN runs.m IS NULL THEN ones.hex
                       ELSE (SELECT string_agg(lpad(to_hex(substring(mm.m FROM c * 64 + 1 FOR 64)::bit(64)::int8), 16, '0'),
                                               '' ORDER BY c)
                             FROM (SELECT runs.m | ('x' || rpad(coalesce(ones.hex, ''), 2 * grp.nbytes, '0'))::varbit AS m) mm,
                                  generate_series(0, (grp.nbytes - 1) / 8) c) END AS hex
           FROM grp LEFT JOIN ones ON ones.b = grp.b AND ones.g = grp.g
                    LEFT JOIN runs ON runs.b = grp.b AND runs.g = grp.g)
    SELECT (SELECT sum(grp.n) FROM grp), array_agg(hx.b ORDER BY hx.first_ord), array_agg(hx.g ORDER BY hx.first_ord),
           array_agg(hx.hex ORDER BY hx.first_ord)
    INTO counted, b_ids, g_ids, hexes
    FROM hx;
    IF b_ids IS NULL THEN
        acked := 0; duplicates := 0; completed := '{}';
        RETURN NEXT;
        RETURN;
    END IF;
    BEGIN
        SELECT * INTO r FROM ack_masks(b_ids, g_ids, hexes, ack.completion_topic);
    EXCEPTION WHEN SQLSTATE 'RT002' OR SQLSTATE 'RT003' OR SQLSTATE 'RT004' OR SQLSTATE 'RT006' THEN
        -- Name the caller's entry as written (a run, not its first bad index), as tracker.ack does:
        -- the first entry of the batch (and group; for RT004 one reaching past the group's size).
        GET STACKED DIAGNOSTICS code = RETURNED_SQLSTATE, culprit = PG_EXCEPTION_DETAIL;
        SELECT t.id, g.size INTO bad, size
        FROM unnest(ids) WITH ORDINALITY t(id, ord)
        CROSS JOIN LATERAL string_to_array(t.id, ':') sp
        CROSS JOIN LATERAL string_to_array(culprit, ':') cp
        LEFT JOIN batch_group g ON g.batch_id = cp[1]::bigint AND g.id = cp[2]::bigint
        WHERE sp[1]::bigint = cp[1]::bigint
          AND (code IN ('RT002', 'RT006') OR sp[2]::bigint = cp[2]::bigint)
          AND (code <> 'RT004'
               OR coalesce(nullif(split_part(sp[3], '-', 2), ''), split_part(sp[3], '-', 1))::integer >= g.size)
        ORDER BY t.ord LIMIT 1;
        bad := coalesce(bad, culprit);
        CASE code
            WHEN 'RT002' THEN
                RAISE EXCEPTION 'unknown batch % (item id %)', split_part(culprit, ':', 1), quote_literal(bad)
                    USING ERRCODE = code, DETAIL = bad;
            WHEN 'RT003' THEN
                RAISE EXCEPTION 'unknown group % in batch % (item id %)', split_part(culprit, ':', 2),
                    split_part(culprit, ':', 1), quote_literal(bad) USING ERRCODE = code, DETAIL = bad;
            WHEN 'RT004' THEN
                RAISE EXCEPTION 'item id % is out of range: its group has % items (index 0..%)', quote_literal(bad),
                    size, size - 1 USING ERRCODE = code, DETAIL = bad;
            ELSE
                RAISE EXCEPTION 'batch % has expired (item id %)', split_part(culprit, ':', 1), quote_literal(bad)
                    USING ERRCODE = code, DETAIL = bad;
        END CASE;
    END;
    acked := r.acked;
    duplicates := greatest(0, counted - r.acked);
    completed := r.completed;
    RETURN NEXT;
END $$;
