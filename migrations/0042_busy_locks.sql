-- Busy marks that producers read as a lock, not as a row.
--
-- Migration 0041's trigger read queue_busy on every INSERT: a table read in
-- a SECURITY DEFINER function, which needed a fresh snapshot (and so made
-- REPEATABLE READ and SERIALIZABLE producers always notify), and cost a
-- producer about a tenth of its throughput at 32 clients (BENCHMARKS.md).
--
-- Now a draining dispatcher also holds a session advisory lock on a second
-- key, (1650814062, hashtext(app_id || ':' || queue_name)), exclusively, on
-- a connection of its own (internal/busylock). The producer tests it with
-- pg_try_advisory_lock_shared and lets it go at once: it fails only while a
-- dispatcher holds the key, and lock state is not MVCC, so the answer is
-- current under every isolation level. The dispatcher's connection ends
-- with the dispatcher, so a crash ends its mark at once; a hung dispatcher
-- loses it to idle_session_timeout, which the dispatcher keeps from firing
-- with keep-alives while it holds marks.
--
-- queue_busy stays: dispatchers still write their marks there, with a
-- lease, so that other dispatchers learn of them ('b:' notifications) and
-- watch them. The rest of the protocol is that of 0041 (docs/busy-marks.md):
--   * the producer takes pg_advisory_xact_lock_shared on the first key
--     (1650814061) BEFORE it tests the second, and holds it until commit;
--   * a dispatcher about to sleep releases the second key, deletes its row,
--     then tries the first key exclusively until it gets it (every producer
--     that saw the second key held has then committed), then claims once
--     more.
--
-- Neither SECURITY DEFINER nor a pinned search_path: the function reads no
-- table and calls only pg_catalog functions, which are available to every
-- role, and a producer who shadowed them could only keep its own
-- notifications from being sent.
CREATE OR REPLACE FUNCTION bellhop_notify_queue_messages() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    r RECORD;
    k INT;
BEGIN
    FOR r IN SELECT DISTINCT app_id, queue_name FROM new_messages ORDER BY app_id, queue_name LOOP
        k := hashtext(r.app_id::text || ':' || r.queue_name);
        -- Held until commit; excludes only a dispatcher's momentary
        -- exclusive try.
        PERFORM pg_advisory_xact_lock_shared(1650814061, k);
        IF pg_try_advisory_lock_shared(1650814062, k) THEN
            -- No dispatcher is draining the queue.
            PERFORM pg_advisory_unlock_shared(1650814062, k);
            PERFORM pg_notify('bellhop', 'q:' || r.app_id::text || ':' || r.queue_name);
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;
