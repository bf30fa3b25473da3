-- Producers at full speed. A transaction that has called pg_notify takes a
-- cluster-wide lock at commit and holds it through the WAL flush, so
-- notifying commits run one at a time. A dispatcher that is busy draining
-- a queue looks again by itself, so while one is busy, producers of that
-- queue skip the notification and its lock.
--
-- queue_busy holds one "busy" mark per (queue, dispatcher), with a lease.
-- It is UNLOGGED: a crash empties it, and a missing mark means "notify",
-- the safe default. The protocol (docs/busy-marks.md, checked by the model
-- in model/) is:
--   * a producer's statement trigger takes pg_advisory_xact_lock_shared on
--     the queue, then notifies only if no live mark exists; the shared lock
--     is held until the producer commits;
--   * a dispatcher marks a queue when a claim pass shows a backlog, and
--     refreshes the lease on every pass while it drains;
--   * before it sleeps, it deletes its mark, then waits (pg_try_advisory_
--     xact_lock, never a blocking exclusive lock) until no producer that
--     might have read the mark is still uncommitted, then claims once more;
--   * other dispatchers that saw a live mark re-check when its lease ends,
--     so a crashed dispatcher's mark delays messages by at most the lease.
CREATE UNLOGGED TABLE queue_busy (
    app_id      UUID NOT NULL,
    queue_name  TEXT NOT NULL,
    owner       UUID NOT NULL,
    lease_until TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (app_id, queue_name, owner)
);

-- SECURITY DEFINER so that producers need no rights on queue_busy;
-- search_path is pinned so they cannot redirect the names used.
CREATE OR REPLACE FUNCTION bellhop_notify_queue_messages() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    r RECORD;
BEGIN
    FOR r IN SELECT DISTINCT app_id, queue_name FROM new_messages ORDER BY app_id, queue_name LOOP
        -- Shared with every other producer; excludes only a dispatcher's
        -- momentary exclusive try (see above). Held until commit.
        PERFORM pg_advisory_xact_lock_shared(1650814061, hashtext(r.app_id::text || ':' || r.queue_name));
        -- Under REPEATABLE READ or SERIALIZABLE the read below would use the
        -- transaction's snapshot, taken before the lock, and could see a
        -- mark already deleted: such producers always notify.
        IF current_setting('transaction_isolation') <> 'read committed'
           OR NOT EXISTS (SELECT 1 FROM queue_busy b
                          WHERE b.app_id = r.app_id AND b.queue_name = r.queue_name
                            AND b.lease_until > clock_timestamp()) THEN
            PERFORM pg_notify('bellhop', 'q:' || r.app_id::text || ':' || r.queue_name);
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;
