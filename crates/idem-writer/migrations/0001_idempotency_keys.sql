-- The authoritative record of every completed idempotency key: the seed's
-- table, with the body as BYTEA (any bytes, not only JSON) and the fields the
-- mirror needs (headers, token, timestamps).
CREATE TABLE idempotency_keys (
    key              TEXT        PRIMARY KEY,
    fingerprint      TEXT        NOT NULL,
    response_body    BYTEA,
    response_status  INT,
    status           TEXT        NOT NULL DEFAULT 'in_progress',
    expires_at       TIMESTAMPTZ NOT NULL,
    response_headers BYTEA[]     NOT NULL DEFAULT '{}',
    token            BIGINT      NOT NULL,
    created_at       TIMESTAMPTZ,
    completed_at     TIMESTAMPTZ,
    CONSTRAINT idempotency_keys_fingerprint_sha256_hex
        CHECK (fingerprint ~ '^[0-9a-f]{64}$'),
    CONSTRAINT idempotency_keys_status_known
        CHECK (status IN ('in_progress', 'completed')),
    CONSTRAINT idempotency_keys_token_positive
        CHECK (token > 0)
);

CREATE INDEX idempotency_keys_expires_at_idx ON idempotency_keys (expires_at);
