-- The fingerprint's expiry (unix milliseconds) on the row it created; NULL for
-- client keys and for rows written before this column. The reaper keeps a row
-- until both its last change and this expiry are older than the retention, so
-- a retry with a fingerprint that is still valid always finds the record.
ALTER TABLE idem_record ADD COLUMN fp_exp_ms BIGINT;
