-- A consumer's visibility timeout may change, or the consumer go, while
-- handlers run under leases measured with the old timeout. A handler's
-- context ends at its lease's end as its dispatcher measured it; a
-- reclaim that used a shorter timeout at once would hand the message to a
-- second handler while the first still runs.
--
-- So each lease is measured with the timeout read in the transaction that
-- took or renewed it (claims: next_due_*.sql, in the claim's transaction;
-- renewals: extend.sql; leases at INSERT: the lease notification, below),
-- and none is delivered, renewed or leased at INSERT for a queue without
-- a consumer. The reclaim never
-- uses a shorter timeout than such a lease can have: when a timeout is
-- lowered, or its consumer removed (its queue then falls back to the
-- dispatcher's default, or to a new consumer's timeout), the old timeout
-- is kept as the queue's floor for as long as a lease taken under it can
-- last. Every such lease began before the change committed; the floor
-- lasts the old timeout from the change's COMMIT (a deferred trigger
-- stamps it there, so a transaction held open does not eat into it), plus
-- five seconds for the commit record to be written. Triggers keep it, so
-- that every way of changing a consumer counts.
CREATE TABLE bellhop_vt_floors (
    app_id     UUID NOT NULL,
    queue_name TEXT NOT NULL,
    vt_secs    INT NOT NULL CHECK (vt_secs BETWEEN 1 AND 43200),
    until      TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (app_id, queue_name)
);
REVOKE ALL ON bellhop_vt_floors FROM PUBLIC;

-- Keeps vt_secs as the queue's floor, at least as long as a live one;
-- until stays 'infinity' (pending) until the transaction commits.
CREATE FUNCTION bellhop_keep_vt_floor(p_app_id UUID, p_queue_name TEXT, p_vt_secs INT) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT set_config('bellhop.vt_floors_pending', 'on', true);
    INSERT INTO bellhop_vt_floors AS f (app_id, queue_name, vt_secs, until)
    VALUES (p_app_id, p_queue_name, p_vt_secs, 'infinity')
    ON CONFLICT (app_id, queue_name) DO UPDATE SET
        vt_secs = CASE WHEN f.until > clock_timestamp() THEN GREATEST(f.vt_secs, EXCLUDED.vt_secs)
                       ELSE EXCLUDED.vt_secs END,
        until   = 'infinity';
$$;
REVOKE EXECUTE ON FUNCTION bellhop_keep_vt_floor(UUID, TEXT, INT) FROM PUBLIC;

-- At COMMIT: the pending floors start, and floors long over are dropped.
-- A live floor that was raised lasts at least as long as before, since
-- its old end was at most its own change plus its timeout plus five
-- seconds. It fires once per changed row (a constraint trigger cannot be
-- per statement) but works once per transaction: deleting an app with
-- ten thousand consumers must not scan the table ten thousand times.
CREATE FUNCTION bellhop_start_vt_floors() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    IF current_setting('bellhop.vt_floors_pending', true) IS DISTINCT FROM 'on' THEN
        RETURN NULL;
    END IF;
    PERFORM set_config('bellhop.vt_floors_pending', 'off', true);
    UPDATE bellhop_vt_floors SET until = clock_timestamp() + make_interval(secs => vt_secs + 5)
    WHERE until = 'infinity';
    DELETE FROM bellhop_vt_floors WHERE until < clock_timestamp() - interval '1 hour';
    RETURN NULL;
END
$$;

CREATE FUNCTION bellhop_vt_lowered() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    IF NEW.visibility_timeout_secs < OLD.visibility_timeout_secs
       OR NEW.queue_name IS DISTINCT FROM OLD.queue_name THEN
        PERFORM bellhop_keep_vt_floor(t.app_id, OLD.queue_name, OLD.visibility_timeout_secs)
        FROM triggers AS t WHERE t.id = OLD.trigger_id;
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER queue_trigger_details_vt_floor
    AFTER UPDATE OF visibility_timeout_secs, queue_name ON queue_trigger_details
    FOR EACH ROW EXECUTE FUNCTION bellhop_vt_lowered();

CREATE CONSTRAINT TRIGGER queue_trigger_details_vt_floor_start
    AFTER UPDATE OF visibility_timeout_secs, queue_name ON queue_trigger_details
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION bellhop_start_vt_floors();

-- On the consumer's own row, before the delete cascades to its details.
CREATE FUNCTION bellhop_vt_removed() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    PERFORM bellhop_keep_vt_floor(OLD.app_id, d.queue_name, d.visibility_timeout_secs)
    FROM queue_trigger_details AS d WHERE d.trigger_id = OLD.id;
    RETURN OLD;
END
$$;

CREATE TRIGGER triggers_vt_floor
    BEFORE DELETE ON triggers
    FOR EACH ROW WHEN (OLD.kind = 'queue') EXECUTE FUNCTION bellhop_vt_removed();

CREATE CONSTRAINT TRIGGER triggers_vt_floor_start
    AFTER DELETE ON triggers
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (OLD.kind = 'queue') EXECUTE FUNCTION bellhop_start_vt_floors();

-- The timeout the reclaim measures a lease of (app, queue) with: the
-- consumer's (p_vt_secs; the caller supplies the default for a queue
-- without one), or the queue's live floor if that is longer.
CREATE FUNCTION bellhop_reclaim_vt(p_app_id UUID, p_queue_name TEXT, p_vt_secs INT) RETURNS INT
LANGUAGE sql STABLE AS $$
    SELECT GREATEST(p_vt_secs,
                    (SELECT f.vt_secs FROM bellhop_vt_floors AS f
                     WHERE f.app_id = p_app_id AND f.queue_name = p_queue_name AND f.until > now()))
$$;

CREATE OR REPLACE FUNCTION bellhop_next_lease_expiry(p_default_vt_secs INT) RETURNS TIMESTAMPTZ
LANGUAGE sql STABLE AS $$
    SELECT least(
        (SELECT min(m.claimed_at + make_interval(secs => bellhop_reclaim_vt(m.app_id, m.queue_name,
                    coalesce(c.visibility_timeout_secs, p_default_vt_secs))))
         FROM queue_messages m
         LEFT JOIN queue_consumers c ON c.app_id = m.app_id AND c.queue_name = m.queue_name
         WHERE m.claim_token IS NOT NULL),
        (SELECT min(m.claimed_at + make_interval(secs => bellhop_reclaim_vt(m.app_id, c.queue_name,
                    coalesce(c.visibility_timeout_secs, p_default_vt_secs))))
         FROM outbox m
         LEFT JOIN queue_consumers c ON c.id = m.trigger_id
         WHERE m.claim_token IS NOT NULL))
$$;

-- An offer names the consumer of the lane that made it (offer_make.sql);
-- offers made before this migration name none, lease nothing, and are
-- replaced at the next poll.
ALTER TABLE bellhop_offers ADD COLUMN consumer_id UUID NULL;

-- The lease notification carries the timeout read in the producer's
-- transaction, after the principal:
--   l:<token>:<id>:<attempt>:<max_attempts>:<enqueued_at µs>:<claimed_at µs>:<principal>:<vt secs>:<payload>
-- and a queue without a consumer leases nothing. Otherwise 0046's function.
CREATE OR REPLACE FUNCTION bellhop_lease_message(p_id UUID, p_app_id UUID, p_queue_name TEXT) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = public, pg_temp
SET enable_seqscan = off AS $$
DECLARE
    offer    bellhop_offers%ROWTYPE;
    leasable boolean;
    m        RECORD;
    vt_secs  INT;
BEGIN
    IF pg_trigger_depth() = 0 OR current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN false;
    END IF;
    SELECT * INTO offer FROM bellhop_offers
    WHERE app_id = p_app_id AND queue_name = p_queue_name AND expires_at > clock_timestamp()
    LIMIT 1
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    -- No lease unless the offer's consumer still serves the queue: nothing
    -- else would measure it. By primary key, from the offer.
    SELECT d.visibility_timeout_secs INTO vt_secs
    FROM queue_trigger_details AS d
    WHERE d.trigger_id = offer.consumer_id AND d.queue_name = p_queue_name;
    IF vt_secs IS NULL THEN
        RETURN false;
    END IF;
    -- The row as it is now: the transaction may have changed it since the
    -- INSERT. A notification holds under 8000 bytes and the header takes
    -- under 200; a larger payload leaves the offer for a smaller message.
    SELECT q.app_id = p_app_id AND q.queue_name = p_queue_name AND q.claim_token IS NULL
           AND (q.deliver_after IS NULL OR q.deliver_after <= clock_timestamp())
           AND octet_length(q.payload::text) <= 7600
    INTO leasable
    FROM queue_messages AS q
    WHERE q.id = p_id
    FOR NO KEY UPDATE;
    IF leasable IS NOT TRUE THEN
        RETURN false;
    END IF;
    UPDATE queue_messages
    SET claim_token = offer.token, claimed_at = clock_timestamp(), attempt = attempt + 1
    WHERE id = p_id
    RETURNING id, payload::text AS body, attempt, max_attempts, enqueued_at, claimed_at,
              enqueued_by_principal
    INTO m;
    DELETE FROM bellhop_offers WHERE token = offer.token;
    PERFORM pg_notify(offer.channel, 'l:' || offer.token::text || ':' || m.id::text
        || ':' || m.attempt::text || ':' || m.max_attempts::text
        || ':' || (extract(epoch FROM m.enqueued_at) * 1000000)::bigint::text
        || ':' || (extract(epoch FROM m.claimed_at) * 1000000)::bigint::text
        || ':' || coalesce(m.enqueued_by_principal::text, '')
        || ':' || vt_secs::text
        || ':' || m.body);
    RETURN true;
END
$$;
