-- The notify trigger as a row trigger whose WHEN clause decides.
--
-- 0042's statement trigger cost a producer about a fifth of its throughput
-- even while a dispatcher drained the queue and nothing was notified: the
-- transition table, a plpgsql call and its loop, on every INSERT
-- (BENCHMARKS.md, "The notify trigger in its WHEN clause"). Issue 7 asks
-- for 0.9 of the trigger-off throughput with 32 producers.
--
-- A row trigger's WHEN clause is a plain expression, evaluated as each row
-- is inserted, and the trigger's function runs only when it is true. The
-- clause does the busy-mark protocol of 0042 (docs/busy-marks.md):
--   1. pg_advisory_xact_lock_shared on the queue's lock (1650814061),
--      held until the end of the transaction;
--   2. THEN pg_try_advisory_lock_shared on the queue's busy key
--      (1650814062), let go at once if granted: true means no dispatcher
--      holds the key, so the function notifies; false means a dispatcher
--      is draining the queue, and no function runs at all.
-- The CASE fixes the order (the lock before the key; a CASE evaluates its
-- branches in order). The key, a session lock, is never held past the
-- clause: one that outlived a statement that failed later (a foreign key,
-- another row) would stay until the producer disconnected.
--
-- A multi-row INSERT or a COPY now runs the function once per row of an
-- idle queue, not once per statement; PostgreSQL still folds the identical
-- notifications of a transaction into one.
CREATE FUNCTION bellhop_notify_queue_message() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- The trigger's WHEN clause found no dispatcher draining the queue.
    PERFORM pg_notify('bellhop', 'q:' || NEW.app_id::text || ':' || NEW.queue_name);
    RETURN NULL;
END
$$;

DROP TRIGGER queue_messages_notify ON queue_messages;

CREATE TRIGGER queue_messages_notify
    AFTER INSERT ON queue_messages
    FOR EACH ROW
    WHEN (CASE
          WHEN pg_advisory_xact_lock_shared(1650814061, hashtext(NEW.app_id::text || ':' || NEW.queue_name)) IS NULL
              THEN false -- never: the lock returns void
          WHEN pg_try_advisory_lock_shared(1650814062, hashtext(NEW.app_id::text || ':' || NEW.queue_name))
              THEN pg_advisory_unlock_shared(1650814062, hashtext(NEW.app_id::text || ':' || NEW.queue_name))
          ELSE false
          END)
    EXECUTE FUNCTION bellhop_notify_queue_message();

DROP FUNCTION bellhop_notify_queue_messages();
