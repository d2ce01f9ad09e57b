-- Approval (DESIGN §4): an operation a person must approve before it runs waits
-- here, one row per nonce, and nothing is written to idem_record (nothing is
-- forwarded) until it is APPROVED. `fields` is the canonical JSON of the bound
-- fields the fingerprint covers (what the approver sees; never free text).
-- `fp_exp_ms` is the fingerprint's exp: an approval not given by then lapses.
-- `decided_by` is the approver's identity; `reason` their words.
CREATE TABLE IF NOT EXISTS idem_approval (
    idem_key     CHAR(32)     NOT NULL,
    state        VARCHAR(24)  NOT NULL,
    param_hash   VARCHAR(128) NOT NULL,
    subject_hash VARCHAR(128) NOT NULL,
    scope        VARCHAR(255) NOT NULL,
    fields       TEXT         NOT NULL,
    fp_exp_ms    BIGINT       NOT NULL,
    created_at   BIGINT       NOT NULL,
    updated_at   BIGINT       NOT NULL,
    decided_by   VARCHAR(128) NULL,
    reason       TEXT         NULL,
    PRIMARY KEY (idem_key),
    -- The console's and the lapse sweep's question: which approvals wait, oldest first?
    KEY idem_approval_state_created (state, created_at),
    CONSTRAINT idem_approval_state_ck CHECK (state IN ('AWAITING_APPROVAL', 'APPROVED', 'REJECTED', 'LAPSED'))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
-- AWAITING_APPROVAL is 17 characters: the audit's state columns grow.
ALTER TABLE idem_audit MODIFY from_state VARCHAR(24) NULL, MODIFY to_state VARCHAR(24) NULL;
