-- Two corrections to 0047's timeout floors.
--
-- A floor started at the COMMIT of the change that made it: a deferred
-- trigger stamped until = clock_timestamp() + the old timeout + 5 s. But a
-- commit becomes visible later than its deferred triggers run: after its
-- WAL flush and, with synchronous replication, after a standby confirms.
-- Until then every claim reads the old timeout, and the dispatchers'
-- own commits (synchronous_commit off) wait for neither. A commit held up
-- longer than the 5 s slack left leases taken under the old timeout that
-- outlasted their floor, and the reclaim handed such a message to a
-- second handler while the first still ran. A floor now starts when a
-- reclaim pass first sees it, which it can only once the change is
-- visible: every lease taken under the old timeout began before that, so
-- it ends within the old timeout of it. Until a pass sees it, the floor
-- is pending ('infinity') and counts in full.
--
-- A consumer's queue renamed while invoke deliveries were leased kept the
-- floor under the old name only, but an invoke delivery's lease is
-- measured under its consumer's current queue name (sql/reclaim.sql): a
-- rename that also lowered the timeout cut those leases short. The floor
-- is now kept under both names.

-- At COMMIT: floors long over are dropped. Pending floors stay pending.
CREATE OR REPLACE FUNCTION bellhop_start_vt_floors() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    IF current_setting('bellhop.vt_floors_pending', true) IS DISTINCT FROM 'on' THEN
        RETURN NULL;
    END IF;
    PERFORM set_config('bellhop.vt_floors_pending', 'off', true);
    DELETE FROM bellhop_vt_floors WHERE until < clock_timestamp() - interval '1 hour';
    RETURN NULL;
END
$$;

-- Starts the pending floors that the calling statement can see, which
-- their changes' commits made visible before it began; returns how many.
-- Rows another transaction has locked (a change not yet committed) are
-- skipped, for a later pass: the reclaim never waits. The reclaim calls it
-- (sql/reclaim.sql) as the dispatcher's role, which cannot write the table
-- itself. Every role may call it: starting a visible floor is what the
-- next pass would do anyway, and a role without a grant would fail every
-- reclaim pass.
CREATE OR REPLACE FUNCTION bellhop_start_seen_vt_floors() RETURNS bigint
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    WITH seen AS (
        SELECT app_id, queue_name FROM bellhop_vt_floors
        WHERE until = 'infinity'
        FOR UPDATE SKIP LOCKED
    ), started AS (
        UPDATE bellhop_vt_floors AS f SET until = clock_timestamp() + make_interval(secs => f.vt_secs + 5)
        FROM seen
        WHERE f.app_id = seen.app_id AND f.queue_name = seen.queue_name AND f.until = 'infinity'
        RETURNING 1
    )
    SELECT count(*) FROM started
$$;

CREATE OR REPLACE FUNCTION bellhop_vt_lowered() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    IF NEW.visibility_timeout_secs < OLD.visibility_timeout_secs
       OR NEW.queue_name IS DISTINCT FROM OLD.queue_name THEN
        PERFORM bellhop_keep_vt_floor(t.app_id, OLD.queue_name, OLD.visibility_timeout_secs)
        FROM triggers AS t WHERE t.id = OLD.trigger_id;
    END IF;
    IF NEW.queue_name IS DISTINCT FROM OLD.queue_name
       AND NEW.visibility_timeout_secs < OLD.visibility_timeout_secs THEN
        PERFORM bellhop_keep_vt_floor(t.app_id, NEW.queue_name, OLD.visibility_timeout_secs)
        FROM triggers AS t WHERE t.id = OLD.trigger_id;
    END IF;
    RETURN NEW;
END
$$;
