-- Takes the lease key (migrations/0045_lease_key.sql) shared, for the
-- session: run on the connection that LISTENs for a leasing dispatcher's
-- leases, so that producers look for offers exactly while some leasing
-- dispatcher can hear them. Shared, so that any number of dispatchers hold
-- it at once. A try, not a wait: a producer holds the key exclusively only
-- for the instant of its test, so the caller retries; returns whether the
-- key is now held. The connection's end lets it go.
SELECT pg_try_advisory_lock_shared(1650814063, 0)
