-- When the next live lease expires (see bellhop_next_lease_expiry in the
-- migrations); the reclaim timer is set from it, so reclaim costs nothing
-- while nothing is in flight.
SELECT bellhop_next_lease_expiry(@default_vt_secs)
