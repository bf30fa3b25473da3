-- Tries the queue's advisory lock exclusively and lets go of it when its
-- transaction ends: at once when it runs alone (claim.TryBusyLock); in
-- claim.Unmark, when the batch it shares with busy_unmark.sql commits,
-- right after it, so that a producer of the queue that comes meanwhile
-- waits only that long.
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
-- notification after this check had passed. The key is tried only once the
-- queue's lock is granted, and that lock is held to the end of the
-- statement, so a producer cannot take it shared between the two tries.
--
-- locked is the answer; key_held says that the queue's lock was granted
-- but the busy key, which @need_free asked to be free, was held by some
-- session: a dispatcher's old backend, or another dispatcher that took the
-- key since (the lane then watches that mark instead of trying again at
-- once: docs/busy-marks.md, step 3).
SELECT granted AND free AS locked, granted AND NOT free AS key_held
FROM (SELECT granted,
             CASE WHEN granted AND @need_free::bool
                  THEN pg_try_advisory_xact_lock_shared(hashtextextended(@app_id::uuid::text || ':' || @queue_name::text, 1650814062))
                  ELSE true
             END AS free
      FROM (SELECT pg_try_advisory_xact_lock(hashtextextended(@app_id::uuid::text || ':' || @queue_name::text, 1650814061)) AS granted) AS q) AS k
