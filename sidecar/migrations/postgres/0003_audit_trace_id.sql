-- The filter's trace id on each audit line: the reference an agent's reply
-- carries, so `idemd ops show <trace id>` finds the operation behind it.
ALTER TABLE idem_audit ADD COLUMN trace_id VARCHAR(128);
CREATE INDEX IF NOT EXISTS idem_audit_trace ON idem_audit (trace_id);
