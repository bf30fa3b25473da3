-- Takes the lease key (migrations/0045_lease_key.sql) shared, for the
-- session, and the dispatcher's owner key (migrations/0055): run on the
-- connection that LISTENs for a leasing dispatcher's leases, so that
-- producers look for offers exactly while some leasing dispatcher can hear
-- them, and use this dispatcher's offers only while it can. A try, not a
-- wait: a producer holds either key exclusively only for the instant of its
-- test, so the caller retries; returns whether both are now held (a key
-- taken twice is held twice, which is harmless). The connection's end lets
-- them go.
SELECT pg_try_advisory_lock_shared(hashtextextended(@owner::uuid::text, 1650814064))
   AND pg_try_advisory_lock_shared(1650814063, 0)
