-- The queue's lock and its busy key (0041, 0042) become 64-bit advisory
-- keys: hashtextextended(app_id || ':' || queue_name, seed), one seed per
-- key. They were (class, hashtext(...)): 32 bits of hash, so among a
-- hundred thousand queues about one pair shared its keys, and a producer
-- could find a name sharing another app's in seconds. While a dispatcher
-- drained one queue of such a pair, the other's producers saw the shared
-- busy key held and skipped their notifications, and nobody watched that
-- queue: its messages waited for the fallback poll.
--
-- The dispatcher's statements (sql/busy_*.sql, next_due_queue.sql,
-- wake_scan.sql) use the same expressions. Run before the dispatchers are
-- upgraded, as every migration is: an old dispatcher's busy key is then
-- one that producers do not test, so they notify, which is safe; and this
-- migration's DROP TRIGGER waits for producers still inserting under the
-- old keys to commit.
DROP TRIGGER queue_messages_notify ON queue_messages;

CREATE CONSTRAINT TRIGGER queue_messages_notify
    AFTER INSERT ON queue_messages
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (CASE
          WHEN pg_advisory_xact_lock_shared(hashtextextended(NEW.app_id::text || ':' || NEW.queue_name, 1650814061)) IS NULL
              THEN false -- never: the lock returns void
          WHEN pg_try_advisory_lock_shared(hashtextextended(NEW.app_id::text || ':' || NEW.queue_name, 1650814062))
              THEN pg_advisory_unlock_shared(hashtextextended(NEW.app_id::text || ':' || NEW.queue_name, 1650814062))
          ELSE false
          END)
    EXECUTE FUNCTION bellhop_notify_queue_message();
