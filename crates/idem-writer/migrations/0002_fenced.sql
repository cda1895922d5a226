-- Rows the Postgres fence committed, in the same transaction as the
-- handler's effect. While such a row is completed and unexpired, the
-- writer's upsert leaves it as it is: a later Redis record of the key (a
-- retry answered before it claimed, after Redis lost the key) must not
-- replace the answer that goes with the effect. Both layouts: on the
-- partitioned one the column reaches every partition.
ALTER TABLE idempotency_keys ADD COLUMN IF NOT EXISTS fenced BOOLEAN NOT NULL DEFAULT false;
