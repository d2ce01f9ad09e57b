-- Security events (a tampered amount, another subject's fingerprint, a forged
-- signature, an unknown key id, a nonce reused with another binding) are audit
-- lines of their own (action 'security_event'): which kind, on which route's
-- scope, sent by which subject (its hash). NULL on state changes.
-- `idemd ops events` lists them newest first.
ALTER TABLE idem_audit
    ADD COLUMN kind VARCHAR(32) NULL,
    ADD COLUMN scope VARCHAR(255) NULL,
    ADD COLUMN subject_hash VARCHAR(128) NULL,
    ADD KEY idem_audit_action_at (action, at_ms);
