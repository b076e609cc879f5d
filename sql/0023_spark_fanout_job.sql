-- A Spark fan-out job that opens its own batch names it by its run key, so that the same job
-- submitted again (after a failure, or by a scheduler that retries) finds its batch and its run
-- instead of opening another batch and publishing every row again (tracker/spark/runs.py). The run
-- that opened its batch is marked, and a run key names at most one such run in the schema. Runs of
-- a batch the caller gave keep their keys per batch, as before.
ALTER TABLE spark_fanout_run ADD COLUMN IF NOT EXISTS opened_batch boolean NOT NULL DEFAULT false;
CREATE UNIQUE INDEX IF NOT EXISTS spark_fanout_run_job ON spark_fanout_run (run_key) WHERE opened_batch;
-- A run records its job's partition count: a partition index names the rows a partition held, so
-- a submission that splits the rows otherwise is refused instead of skipping indexes written with
-- other rows (each partition's row count is the size of its groups).
ALTER TABLE spark_fanout_run ADD COLUMN IF NOT EXISTS partitions integer
    CHECK (partitions >= 0 AND partitions <= 1048576);  -- the 20 bits of the group id
