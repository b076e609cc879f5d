-- Spark fan-out runs. A fan-out job takes a run number of its batch before it starts; its
-- partitions then name their groups from (run, partition id, chunk), in a range of group ids
-- that counter-allocated groups (batch.next_group) never reach, so a retried or speculative task
-- attempt finds its groups already there (ON CONFLICT DO NOTHING) and writes nothing twice.
-- run_key lets a caller re-run a failed job as the same run: partitions already written are skipped.
CREATE TABLE spark_fanout_run (
    batch_id   bigint      NOT NULL REFERENCES batch (id) ON DELETE CASCADE,
    run        integer     NOT NULL CHECK (run >= 0 AND run < 4194304),  -- 22 bits of the group id
    run_key    text,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (batch_id, run),
    UNIQUE (batch_id, run_key)
);
