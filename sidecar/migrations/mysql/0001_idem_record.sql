-- The truth: one row per nonce. The primary key is what makes "at most once"
-- hold when Redis has forgotten everything.
-- Timestamps are unix milliseconds (BIGINT), the same in all three dialects.
-- utf8mb4 with its default (non-binary) collation: sqlx reads *_bin columns
-- as bytes, and every compared value is validated lowercase hex anyway.
CREATE TABLE IF NOT EXISTS idem_record (
    idem_key     CHAR(32)     NOT NULL,
    state        VARCHAR(16)  NOT NULL,
    param_hash   VARCHAR(128) NOT NULL,
    subject_hash VARCHAR(128) NOT NULL,
    scope        VARCHAR(255) NOT NULL,
    owner        VARCHAR(64)  NULL,
    result       MEDIUMTEXT   NULL,
    lease_until  BIGINT       NULL,
    created_at   BIGINT       NOT NULL,
    updated_at   BIGINT       NOT NULL,
    PRIMARY KEY (idem_key),
    -- The reconciler's question: which IN_FLIGHT leases have run out?
    KEY idem_record_state_lease (state, lease_until),
    CONSTRAINT idem_record_state_ck CHECK (state IN ('IN_FLIGHT', 'DONE', 'FAILED', 'NEEDS_REVIEW'))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
