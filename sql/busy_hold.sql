-- Marks a queue busy for producers (migrations/0042_busy_locks.sql): takes
-- the queue's busy key exclusively, as a session lock, on the dispatcher's
-- lock connection (internal/busylock), without waiting: false if another
-- dispatcher holds it, or a producer is testing it at this instant. It is
-- held until busy_release.sql or the end of the session.
--
-- Sets idle_session_timeout so that a hung dispatcher's session, and so its
-- marks, end: the dispatcher sends keep-alives while it holds marks.
SELECT set_config('idle_session_timeout', @idle_ms::bigint::text, false) IS NULL AS unset,
       pg_try_advisory_lock(1650814062, hashtext(@app_id::text || ':' || @queue_name::text)) AS held
