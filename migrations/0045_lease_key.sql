-- The lease key: producers look for an offer only while a dispatcher that
-- leases at INSERT is connected. In 0044 every message to an idle queue
-- ran a SECURITY DEFINER function with a pinned search_path and looked up
-- bellhop_offers, whether any dispatcher leased or not. That cost
-- producers of idle queues 5 - 16 % of their one-message transactions and
-- a 10,000-row INSERT 17 - 32 % of its time (BENCHMARKS.md, "Leasing at
-- INSERT").
--
-- A leasing dispatcher holds the advisory key (1650814063, 0) shared, on
-- the connection that LISTENs for its leases (notify.Config.OnConnect), so
-- the key is held exactly while a leasing dispatcher can hear a lease. The
-- notify function tries the key exclusively and lets it go at once: if it
-- got it, no leasing dispatcher is connected, and the function sends q: as
-- 0043's did, with no table read, no SECURITY DEFINER and no search_path
-- switch. If it did not, it calls bellhop_lease_message, which is 0044's
-- lease, unchanged.
--
-- Every outcome of the test is safe; only its cost differs:
--   * key free, an offer left in the table (a dispatcher that died or lost
--     its listener): the message goes the q: way and the offer stays
--     untouched until its owner's poll or expiry removes it, which is
--     better than 0044, which leased it to nobody.
--   * key taken by another producer testing it at the same moment, with no
--     dispatcher leasing: a lookup that finds nothing, then q:, as in 0044.
--   * a dispatcher taking or dropping the key between this test and the
--     lookup: the lookup decides, as in 0044. A dispatcher takes the key
--     before it LISTENs on its lease channel, and recovers every lease of
--     its offers once it listens (dispatcher.go, control), so a lease made
--     in between is not lost.
-- The exclusive try and its unlock are one expression, as the busy key's
-- are in the WHEN clause: no interrupt is served between them, so a
-- producer never keeps the key past the call.
--
-- The keys: 1650814060 is 'bell' as four bytes; ...61 is the queue lock,
-- ...62 the busy key (0042), ...63 the lease key.

-- 0044's lease, as a function of its own, so that only producers that may
-- lease pay for SECURITY DEFINER. It leases only the message p_id of the
-- queue named, only if it is ready, and only from inside a trigger: a
-- caller cannot point it at another queue's offer, and what it does is
-- what a claim of that message would do.
CREATE FUNCTION bellhop_lease_message(p_id UUID, p_app_id UUID, p_queue_name TEXT) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    offer bellhop_offers%ROWTYPE;
    m     RECORD;
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
    -- The row as it is now: the transaction may have changed it since the
    -- INSERT. A notification holds under 8000 bytes and the header takes
    -- under 200; a larger payload leaves the offer for a smaller message.
    UPDATE queue_messages
    SET claim_token = offer.token, claimed_at = clock_timestamp(), attempt = attempt + 1
    WHERE id = p_id AND app_id = p_app_id AND queue_name = p_queue_name AND claim_token IS NULL
      AND (deliver_after IS NULL OR deliver_after <= clock_timestamp())
      AND octet_length(payload::text) <= 7600
    RETURNING id, payload::text AS body, attempt, max_attempts, enqueued_at, claimed_at,
              enqueued_by_principal
    INTO m;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    DELETE FROM bellhop_offers WHERE token = offer.token;
    PERFORM pg_notify(offer.channel, 'l:' || offer.token::text || ':' || m.id::text
        || ':' || m.attempt::text || ':' || m.max_attempts::text
        || ':' || (extract(epoch FROM m.enqueued_at) * 1000000)::bigint::text
        || ':' || (extract(epoch FROM m.claimed_at) * 1000000)::bigint::text
        || ':' || coalesce(m.enqueued_by_principal::text, '')
        || ':' || m.body);
    RETURN true;
END
$$;

-- Neither SECURITY DEFINER nor a pinned search_path: like 0043's, the
-- function reads no table itself and calls only pg_catalog functions and
-- bellhop_lease_message, schema-qualified. It runs at COMMIT (0044's
-- deferred constraint trigger, kept with its WHEN clause).
CREATE OR REPLACE FUNCTION bellhop_notify_queue_message() RETURNS trigger
LANGUAGE plpgsql SECURITY INVOKER AS $$
BEGIN
    IF NEW.claim_token IS NULL AND (NEW.deliver_after IS NULL OR NEW.deliver_after <= clock_timestamp())
       AND current_setting('transaction_isolation') = 'read committed' THEN
        -- True when the key is held: a leasing dispatcher is connected
        -- (or another producer is testing the key this very moment).
        IF (CASE WHEN pg_try_advisory_lock(1650814063, 0) THEN NOT pg_advisory_unlock(1650814063, 0)
                 ELSE true END) THEN
            IF public.bellhop_lease_message(NEW.id, NEW.app_id, NEW.queue_name) THEN
                RETURN NULL;
            END IF;
        END IF;
    END IF;
    PERFORM pg_notify('bellhop', 'q:' || NEW.app_id::text || ':' || NEW.queue_name);
    RETURN NULL;
END
$$;
