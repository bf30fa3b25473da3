-- At a clean stop: deletes all of @owner's offers, waiting (under the
-- caller's lock_timeout) for a producer that has locked one. That producer
-- holds the lock only until its COMMIT ends; once it has committed, the
-- offer is gone and its lease is visible to offer_recover.sql, which the
-- stop runs next and which releases it with its attempt refunded. Skipping
-- it instead (offer_drop.sql) left a lease committed after the stop's
-- lookup to run out, its attempt spent.
DELETE FROM bellhop_offers WHERE owner = @owner
RETURNING token
