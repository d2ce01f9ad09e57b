-- A business reference names one operation per scope (DESIGN §4, "A reference proves only its own
-- operation"): the reconciler settles an operation by what its upstream answers under the
-- reference, so a reference two rows share would let one operation be told the other's result.
-- `bound_fields` is the canonical JSON of the operation's bound fields (the filter sends it with the
-- reference): a record found under the reference settles the operation only if it carries them.
ALTER TABLE idem_record ADD COLUMN bound_fields MEDIUMTEXT NULL;
-- References rows shared before this migration prove neither row: they are cleared, so the
-- reconciler sends such a row to a person instead of settling it by another's record.
UPDATE idem_record r
  JOIN (SELECT scope, business_ref FROM idem_record WHERE business_ref IS NOT NULL
         GROUP BY scope, business_ref HAVING COUNT(*) > 1) shared
    ON r.scope = shared.scope AND r.business_ref = shared.business_ref
   SET r.business_ref = NULL;
-- The one holder: a second operation's insert with the same reference inserts nothing. The
-- columns' collation compares case- and trailing-space-insensitively, so here "INV-7" and "inv-7"
-- are one reference (stricter than the other dialects, never looser). 4 × (255 + 256) bytes fit
-- InnoDB's 3072-byte key.
CREATE UNIQUE INDEX idem_record_scope_ref ON idem_record (scope, business_ref);
