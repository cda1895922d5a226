-- The lease of a fence's durable claim: the fence commits a key's
-- `in_progress` row before the handler calls anything outside Postgres, and
-- until `lease_expires_at` a retry's claim answers "in flight" instead of
-- taking the key over (docs/fence.md). NULL (rows the writer mirrored, and
-- claims from before this column) counts as lapsed. Both layouts.
ALTER TABLE idempotency_keys ADD COLUMN IF NOT EXISTS lease_expires_at TIMESTAMPTZ;
