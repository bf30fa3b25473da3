-- Tries the queue's advisory lock exclusively and lets go of it at once
-- (it is transaction-scoped and the statement is its own transaction).
-- True means no producer holds it shared, so every producer that might
-- have seen the queue marked busy has committed or rolled back, and its
-- messages are visible to the next claim pass. Never a blocking wait: a
-- waiting exclusive request would queue every new producer of the queue
-- behind it.
--
-- With @need_free it also requires that no session holds the busy key
-- (busy_hold.sql): after a dispatcher lost its hold without seeing it
-- released (its connection broke), the old backend may still hold the key
-- for a moment, and a producer that sees it held would skip its
-- notification after this check had passed.
SELECT pg_try_advisory_xact_lock(hashtextextended(@app_id::uuid::text || ':' || @queue_name::text, 1650814061))
       AND (NOT @need_free::bool
            OR pg_try_advisory_xact_lock_shared(hashtextextended(@app_id::uuid::text || ':' || @queue_name::text, 1650814062)))
