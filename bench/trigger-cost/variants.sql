-- Variants of the queue_messages notify trigger, to tell what each part of
-- bellhop_notify_queue_messages (migrations/0042_busy_locks.sql, before it
-- 0041_busy_marks.sql) costs a producer. run.sh installs one at a time as
-- queue_messages_notify; none of them is safe to leave in place: only
-- "current" keeps the busy-mark protocol. The keys and channel are those of
-- 0041 and 0042.
--
-- Not a variant: "current" folded into one statement (lock and lookup in
-- one query). Under READ COMMITTED a statement reads with the snapshot it
-- took when it started, before it took the lock, so it could see a mark
-- that the dispatcher had already deleted and then skip the notification
-- that the dispatcher's last claim relied on. The lookup must be a
-- statement of its own, started after the lock.

-- Statement-level, with the transition table, doing nothing.
CREATE OR REPLACE FUNCTION bench_tc_stmt_empty() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RETURN NULL;
END $$;

-- ... plus the loop over the distinct queues of the transition table.
CREATE OR REPLACE FUNCTION bench_tc_stmt_loop() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE r RECORD;
BEGIN
    FOR r IN SELECT DISTINCT app_id, queue_name FROM new_messages ORDER BY app_id, queue_name LOOP
    END LOOP;
    RETURN NULL;
END $$;

-- ... plus the shared advisory lock.
CREATE OR REPLACE FUNCTION bench_tc_stmt_lock() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE r RECORD;
BEGIN
    FOR r IN SELECT DISTINCT app_id, queue_name FROM new_messages ORDER BY app_id, queue_name LOOP
        PERFORM pg_advisory_xact_lock_shared(1650814061, hashtext(r.app_id::text || ':' || r.queue_name));
    END LOOP;
    RETURN NULL;
END $$;

-- ... or plus the busy-mark lookup (and the notification when unmarked),
-- without the lock.
CREATE OR REPLACE FUNCTION bench_tc_stmt_lookup() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE r RECORD;
BEGIN
    FOR r IN SELECT DISTINCT app_id, queue_name FROM new_messages ORDER BY app_id, queue_name LOOP
        IF current_setting('transaction_isolation') <> 'read committed'
           OR NOT EXISTS (SELECT 1 FROM queue_busy b
                          WHERE b.app_id = r.app_id AND b.queue_name = r.queue_name
                            AND b.lease_until > clock_timestamp()) THEN
            PERFORM pg_notify('bellhop', 'q:' || r.app_id::text || ':' || r.queue_name);
        END IF;
    END LOOP;
    RETURN NULL;
END $$;

-- Row-level, doing nothing.
CREATE OR REPLACE FUNCTION bench_tc_row_empty() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RETURN NULL;
END $$;

-- Row-level, with the lock and the lookup of "current": no transition
-- table, but the work is done once per row instead of once per queue.
CREATE OR REPLACE FUNCTION bench_tc_row_full() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(1650814061, hashtext(NEW.app_id::text || ':' || NEW.queue_name));
    IF current_setting('transaction_isolation') <> 'read committed'
       OR NOT EXISTS (SELECT 1 FROM queue_busy b
                      WHERE b.app_id = NEW.app_id AND b.queue_name = NEW.queue_name
                        AND b.lease_until > clock_timestamp()) THEN
        PERFORM pg_notify('bellhop', 'q:' || NEW.app_id::text || ':' || NEW.queue_name);
    END IF;
    RETURN NULL;
END $$;



-- row_full plus a memo: the transaction-local setting bellhop.announced
-- holds the last queue this transaction announced, so that further rows
-- of that queue (a multi-row INSERT, or more statements) skip the work.
-- set_config(..., true) outlives the function: its SET clause restores
-- only search_path.
CREATE OR REPLACE FUNCTION bench_tc_row_memo() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    k text := NEW.app_id::text || ':' || NEW.queue_name;
BEGIN
    IF current_setting('bellhop.announced', true) IS NOT DISTINCT FROM k THEN
        RETURN NULL;
    END IF;
    PERFORM pg_advisory_xact_lock_shared(1650814061, hashtext(k));
    IF current_setting('transaction_isolation') <> 'read committed'
       OR NOT EXISTS (SELECT 1 FROM queue_busy b
                      WHERE b.app_id = NEW.app_id AND b.queue_name = NEW.queue_name
                        AND b.lease_until > clock_timestamp()) THEN
        PERFORM pg_notify('bellhop', 'q:' || k);
    END IF;
    PERFORM set_config('bellhop.announced', k, true);
    RETURN NULL;
END $$;

-- A BEFORE row trigger whose WHEN clause holds the memo: the clause is
-- evaluated as each row is inserted (an AFTER row trigger's clause is too,
-- but its function runs only at the end of the statement, after every
-- row's clause saw no memo), so only the first row of a queue in a
-- transaction calls the function. Announcing before the row exists is
-- still safe: nobody sees the row before the commit, and the lock is held
-- until then. run.sh creates it with
--   WHEN (current_setting('bellhop.announced', true)
--         IS DISTINCT FROM NEW.app_id::text || ':' || NEW.queue_name)
CREATE OR REPLACE FUNCTION bench_tc_before_memo() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    k text := NEW.app_id::text || ':' || NEW.queue_name;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(1650814061, hashtext(k));
    IF current_setting('transaction_isolation') <> 'read committed'
       OR NOT EXISTS (SELECT 1 FROM queue_busy b
                      WHERE b.app_id = NEW.app_id AND b.queue_name = NEW.queue_name
                        AND b.lease_until > clock_timestamp()) THEN
        PERFORM pg_notify('bellhop', 'q:' || k);
    END IF;
    PERFORM set_config('bellhop.announced', k, true);
    RETURN NEW;
END $$;

-- Migration 0041's trigger, which read the mark as a row of queue_busy
-- (under a fresh snapshot, so only in READ COMMITTED), for comparison with
-- "current".
CREATE OR REPLACE FUNCTION bench_tc_stmt_0041() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    r RECORD;
BEGIN
    FOR r IN SELECT DISTINCT app_id, queue_name FROM new_messages ORDER BY app_id, queue_name LOOP
        PERFORM pg_advisory_xact_lock_shared(1650814061, hashtext(r.app_id::text || ':' || r.queue_name));
        IF current_setting('transaction_isolation') <> 'read committed'
           OR NOT EXISTS (SELECT 1 FROM queue_busy b
                          WHERE b.app_id = r.app_id AND b.queue_name = r.queue_name
                            AND b.lease_until > clock_timestamp()) THEN
            PERFORM pg_notify('bellhop', 'q:' || r.app_id::text || ':' || r.queue_name);
        END IF;
    END LOOP;
    RETURN NULL;
END $$;

-- The mark as a lock instead of a row (migration 0042's trigger, before
-- 0043 moved it into a row trigger's WHEN clause, which is "current" now;
-- kept so that the recorded runs can be repeated): a draining dispatcher would hold a
-- session advisory lock on a second key (1650814062) exclusively, and a
-- producer, after the shared lock of "current", tries that key shared and
-- lets it go at once; failing means busy. Lock state is not MVCC, so the
-- read needs no fresh snapshot and works under every isolation level, and
-- without a table read the function needs no SECURITY DEFINER. run.sh
-- holds the second key during the run, as a draining dispatcher would.
CREATE OR REPLACE FUNCTION bench_tc_stmt_locks() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    r RECORD;
    k INT;
BEGIN
    FOR r IN SELECT DISTINCT app_id, queue_name FROM new_messages ORDER BY app_id, queue_name LOOP
        k := hashtext(r.app_id::text || ':' || r.queue_name);
        PERFORM pg_advisory_xact_lock_shared(1650814061, k);
        IF pg_try_advisory_lock_shared(1650814062, k) THEN
            PERFORM pg_advisory_unlock_shared(1650814062, k);
            PERFORM pg_notify('bellhop', 'q:' || r.app_id::text || ':' || r.queue_name);
        END IF;
    END LOOP;
    RETURN NULL;
END $$;

-- The same, row-level: no transition table, the work once per row.
CREATE OR REPLACE FUNCTION bench_tc_row_locks() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    k INT := hashtext(NEW.app_id::text || ':' || NEW.queue_name);
BEGIN
    PERFORM pg_advisory_xact_lock_shared(1650814061, k);
    IF pg_try_advisory_lock_shared(1650814062, k) THEN
        PERFORM pg_advisory_unlock_shared(1650814062, k);
        PERFORM pg_notify('bellhop', 'q:' || NEW.app_id::text || ':' || NEW.queue_name);
    END IF;
    RETURN NULL;
END $$;
