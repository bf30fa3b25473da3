-- Bounds how long a clean stop's offer_drop_all.sql, in the same
-- transaction, waits for a producer holding one of the offers: the
-- producer holds it only through its commit, unless it fired its deferred
-- trigger early and keeps its transaction open.
SET LOCAL lock_timeout = '2s'
