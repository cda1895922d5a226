-- The partitioned layout of migration 1 (`idem-writer migrate --layout
-- partitioned`): the same columns and checks, range-partitioned by
-- expires_at, one partition per UTC day (created ahead by the writer) plus
-- idempotency_keys_never for rows whose Redis key has no TTL (9999-12-31).
-- A key can no longer be unique on its own (a unique index of a partitioned
-- table must include the partition key); one row per key is kept by the
-- per-key advisory lock every writer of the table takes (docs/writer.md).
-- The primary key's prefix serves the lookups by key; no expires_at index
-- is needed (the partitions are that index).
CREATE TABLE idempotency_keys (
    key              TEXT        NOT NULL,
    fingerprint      TEXT        NOT NULL,
    response_body    BYTEA,
    response_status  INT,
    status           TEXT        NOT NULL DEFAULT 'in_progress',
    expires_at       TIMESTAMPTZ NOT NULL,
    response_headers BYTEA[]     NOT NULL DEFAULT '{}',
    token            BIGINT      NOT NULL,
    created_at       TIMESTAMPTZ,
    completed_at     TIMESTAMPTZ,
    CONSTRAINT idempotency_keys_pkey PRIMARY KEY (key, expires_at),
    CONSTRAINT idempotency_keys_fingerprint_sha256_hex
        CHECK (fingerprint ~ '^[0-9a-f]{64}$'),
    CONSTRAINT idempotency_keys_status_known
        CHECK (status IN ('in_progress', 'completed')),
    CONSTRAINT idempotency_keys_token_positive
        CHECK (token > 0)
) PARTITION BY RANGE (expires_at);

CREATE TABLE idempotency_keys_never PARTITION OF idempotency_keys
    FOR VALUES FROM ('9999-12-31 00:00:00+00') TO (MAXVALUE);
