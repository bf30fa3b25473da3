-- Ends a queue's busy mark for producers: releases the busy key that
-- busy_hold.sql took. @idle_ms is the new idle_session_timeout: 0 (off)
-- once the session holds no more marks, so that an idle dispatcher's lock
-- connection needs no keep-alives.
SELECT set_config('idle_session_timeout', @idle_ms::bigint::text, false) IS NULL AS unset,
       pg_advisory_unlock(hashtextextended(@app_id::uuid::text || ':' || @queue_name::text, 1650814062)) AS released
