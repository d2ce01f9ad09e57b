-- The reconciler counts failed status lookups per row: past the retry budget
-- the row goes to NEEDS_REVIEW instead of being asked about forever.
ALTER TABLE idem_record ADD COLUMN reconcile_attempts INTEGER NOT NULL DEFAULT 0;
-- The reaper's and the operator list's question: which rows in this state are oldest?
CREATE INDEX IF NOT EXISTS idem_record_state_updated ON idem_record (state, updated_at);

-- Who moved which operation from what to what, when and why: the filter, a
-- reconciler or an operator. Append-only; `idemd ops show` prints it.
CREATE TABLE IF NOT EXISTS idem_audit (
    id         INTEGER      PRIMARY KEY AUTOINCREMENT,
    idem_key   CHAR(32)     NOT NULL,
    at_ms      BIGINT       NOT NULL,
    actor      VARCHAR(128) NOT NULL,
    action     VARCHAR(32)  NOT NULL,
    from_state VARCHAR(16),
    to_state   VARCHAR(16),
    why        TEXT         NOT NULL
);
CREATE INDEX IF NOT EXISTS idem_audit_key ON idem_audit (idem_key, id);
CREATE INDEX IF NOT EXISTS idem_audit_at ON idem_audit (at_ms);
