-- Security events (a tampered amount, another subject's fingerprint, a forged
-- signature, an unknown key id, a nonce reused with another binding) are audit
-- lines of their own (action 'security_event'): which kind, on which route's
-- scope, sent by which subject (its hash). NULL on state changes.
-- `idemd ops events` lists them newest first.
ALTER TABLE idem_audit
    ADD COLUMN kind VARCHAR(32),
    ADD COLUMN scope VARCHAR(255),
    ADD COLUMN subject_hash VARCHAR(128);
CREATE INDEX IF NOT EXISTS idem_audit_action_at ON idem_audit (action, at_ms);
