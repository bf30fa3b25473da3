-- Marks a queue busy for producers (migrations/0042_busy_locks.sql): takes
-- the queue's busy key exclusively, as a session lock, on the dispatcher's
-- lock connection (internal/busylock), without waiting: false if another
-- dispatcher holds it, or a producer is testing it at this instant. It is
-- held until busy_release.sql or the end of the session.
--
-- When it gets the key, the same statement tells every dispatcher
-- ("b:<app_id>:<owner>:<queue_name>", as busy_mark.sql does for a new row),
-- so that idle ones watch the key until it is free. From here on producers
-- may skip their notification, and the one dispatcher that knows about it
-- may die before its next round trip; sent in the same statement, the
-- notification goes out with the key's grant (the implicit transaction's
-- commit) or not at all (model/README.md, finding A).
--
-- Sets idle_session_timeout to @idle_ms while the session holds a key
-- (this one, or others: @holding), so that a hung dispatcher's session, and
-- so its marks, end: the dispatcher sends keep-alives while it holds marks,
-- and only then. A session refused the key that holds none gets 0 (off),
-- as busy_release.sql leaves it after its last key: with the timeout armed
-- and no keep-alives, the server ended it after @idle_ms, and the next hold
-- failed, so that the lane counted the key, held by another dispatcher, as
-- lost, and settled every 20 ms until that one let go.
WITH k AS MATERIALIZED (
    SELECT pg_try_advisory_lock(hashtextextended(@app_id::uuid::text || ':' || @queue_name::text, 1650814062)) AS held
)
SELECT set_config('idle_session_timeout',
                  (CASE WHEN k.held OR @holding::bool THEN @idle_ms::bigint ELSE 0 END)::text, false) IS NULL AS unset,
       k.held,
       (SELECT count(pg_notify('bellhop', 'b:' || @app_id::uuid::text || ':' || @owner::uuid::text || ':' || @queue_name::text))
        FROM k WHERE k.held) AS notified
FROM k
