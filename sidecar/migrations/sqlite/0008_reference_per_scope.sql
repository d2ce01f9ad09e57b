-- A business reference names one operation per scope (DESIGN §4, "A reference proves only its own
-- operation"): the reconciler settles an operation by what its upstream answers under the
-- reference, so a reference two rows share would let one operation be told the other's result.
-- `bound_fields` is the canonical JSON of the operation's bound fields (the filter sends it with the
-- reference): a record found under the reference settles the operation only if it carries them.
ALTER TABLE idem_record ADD COLUMN bound_fields TEXT;
-- References rows shared before this migration prove neither row: they are cleared, so the
-- reconciler sends such a row to a person instead of settling it by another's record.
UPDATE idem_record SET business_ref = NULL
 WHERE business_ref IS NOT NULL
   AND EXISTS (SELECT 1 FROM idem_record o
                WHERE o.scope = idem_record.scope AND o.business_ref = idem_record.business_ref
                  AND o.idem_key <> idem_record.idem_key);
-- The one holder: a second operation's insert with the same reference inserts nothing.
CREATE UNIQUE INDEX IF NOT EXISTS idem_record_scope_ref ON idem_record (scope, business_ref);
