-- The truth: one row per nonce. The primary key is what makes "at most once"
-- hold when Redis has forgotten everything.
-- Timestamps are unix milliseconds (BIGINT), the same in all three dialects.
CREATE TABLE IF NOT EXISTS idem_record (
    idem_key     CHAR(32)     NOT NULL PRIMARY KEY,
    state        VARCHAR(16)  NOT NULL
                 CHECK (state IN ('IN_FLIGHT', 'DONE', 'FAILED', 'NEEDS_REVIEW')),
    param_hash   VARCHAR(128) NOT NULL,
    subject_hash VARCHAR(128) NOT NULL,
    scope        VARCHAR(255) NOT NULL,
    owner        VARCHAR(64),
    result       TEXT,
    lease_until  BIGINT,
    created_at   BIGINT       NOT NULL,
    updated_at   BIGINT       NOT NULL
);
-- The reconciler's question: which IN_FLIGHT leases have run out?
CREATE INDEX IF NOT EXISTS idem_record_state_lease ON idem_record (state, lease_until);
