-- When the next live lease expires (see bellhop_next_lease_expiry in the
-- migrations); the reclaim timer is set from it, so reclaim costs nothing
-- while nothing is in flight. The database's clock comes with it, so that
-- the timer runs on the dispatcher's clock (claim.LocalClock).
SELECT bellhop_next_lease_expiry(@default_vt_secs), clock_timestamp()
