-- Tries the queue's advisory lock exclusively and lets go of it at once
-- (it is transaction-scoped and the statement is its own transaction).
-- True means no producer holds it shared, so every producer that might
-- have read a busy mark has committed or rolled back, and its messages are
-- visible to the next claim pass. Never a blocking wait: a waiting
-- exclusive request would queue every new producer of the queue behind it.
SELECT pg_try_advisory_xact_lock(1650814061, hashtext(@app_id::text || ':' || @queue_name::text))
