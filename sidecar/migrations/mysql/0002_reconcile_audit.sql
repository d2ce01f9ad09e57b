-- The reconciler counts failed status lookups per row: past the retry budget
-- the row goes to NEEDS_REVIEW instead of being asked about forever.
ALTER TABLE idem_record
    ADD COLUMN reconcile_attempts INT NOT NULL DEFAULT 0,
    -- The reaper's and the operator list's question: which rows in this state are oldest?
    ADD KEY idem_record_state_updated (state, updated_at);

-- Who moved which operation from what to what, when and why: the filter, a
-- reconciler or an operator. Append-only; `idemd ops show` prints it.
CREATE TABLE IF NOT EXISTS idem_audit (
    id         BIGINT       NOT NULL AUTO_INCREMENT,
    idem_key   CHAR(32)     NOT NULL,
    at_ms      BIGINT       NOT NULL,
    actor      VARCHAR(128) NOT NULL,
    action     VARCHAR(32)  NOT NULL,
    from_state VARCHAR(16)  NULL,
    to_state   VARCHAR(16)  NULL,
    why        TEXT         NOT NULL,
    PRIMARY KEY (id),
    KEY idem_audit_key (idem_key, id),
    KEY idem_audit_at (at_ms)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
