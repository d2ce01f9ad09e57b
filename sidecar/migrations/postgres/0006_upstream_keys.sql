-- What the reconciler needs for an upstream that ignores Idempotency-Key (a
-- route's `upstream_keys: ignored`): `upstream_ignores_keys` 1 for such a
-- row, 0 for one whose upstream deduplicates by key, NULL for rows written
-- before this column (read as 0, the default they were written under); and
-- `business_ref`, the confirm's value at the route's `business_ref` pointer
-- (a client reference the upstream stores), NULL where the route names none.
-- A by-key 404 proves nothing for such a row (the upstream never stored the
-- key): it is looked up by business_ref, else goes to NEEDS_REVIEW.
ALTER TABLE idem_record
    ADD COLUMN business_ref VARCHAR(256),
    ADD COLUMN upstream_ignores_keys INTEGER;
