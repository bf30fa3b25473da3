-- bellhop_lease_message leases only a row whose enqueued_at fits the
-- lease notification's field, a bigint of microseconds since 1970: up to
-- about 294247-01-10 04:00:54 UTC (extract's numeric is coarser than a
-- microsecond that far out, so the test is on the very expression the
-- cast takes, not on a time). PostgreSQL takes times up to the year
-- 294276, 0056 requires only that they be finite, and the producer role
-- may set enqueued_at (docs/roles.sql). For a later one, while a leasing
-- dispatcher had a live offer of the queue, the function failed "bigint
-- out of range" at the producer's COMMIT, where the deferred trigger
-- runs, and the producer's whole transaction rolled back with an error
-- that named neither enqueued_at nor the message; without an offer the
-- same row committed. Such a row is now not leased: it is announced with
-- q: and claimed, as a row too large for a notification is, and the offer
-- is left for another message. The test is with the others on the row,
-- before anything is changed. The earliest time PostgreSQL takes, in
-- 4714 BC, is about -2.1e17 microseconds, well within a bigint; claimed_at
-- is the server's clock.
--
-- Copied from 0055 otherwise word for word. The differences: the last line
-- of the leasable test (enqueued_at's microseconds since 1970 at most
-- 9223372036854775807), and the line of comment above that test that
-- says so. CREATE OR REPLACE keeps the function's owner and grants.
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
    -- The row as it is now: the transaction may have changed it since the
    -- INSERT. A notification holds under 8000 bytes and the header takes
    -- under 200; a larger payload leaves the offer for a smaller message.
    -- xmin is a 32-bit transaction id, the low half of the 64-bit one.
    -- enqueued_at must fit the notification's bigint of microseconds.
    -- The tests are in the select list, not the WHERE clause, so that the
    -- row is found by primary key (0046), never through the queue's
    -- unclaimed messages.
    SELECT q.app_id = p_app_id AND q.queue_name = p_queue_name
           AND q.xmin::text::bigint = pg_current_xact_id()::text::bigint % 4294967296
           AND q.claim_token IS NULL
           AND (q.deliver_after IS NULL OR q.deliver_after <= clock_timestamp())
           AND octet_length(q.payload::text) <= 7600
           AND extract(epoch FROM q.enqueued_at) * 1000000 <= 9223372036854775807
    INTO leasable
    FROM queue_messages AS q
    WHERE q.id = p_id;
    IF leasable IS NOT TRUE THEN
        RETURN false;
    END IF;
    -- Only an offer whose owner's listener is connected: it holds its
    -- owner key shared (lease_key_hold.sql). Tried exclusively and let go
    -- at once, in one expression, as 0045 tests the lease key.
    SELECT * INTO offer FROM bellhop_offers AS o
    WHERE o.app_id = p_app_id AND o.queue_name = p_queue_name AND o.expires_at > clock_timestamp()
      AND (CASE WHEN pg_try_advisory_lock(hashtextextended(o.owner::text, 1650814064))
                THEN NOT pg_advisory_unlock(hashtextextended(o.owner::text, 1650814064))
                ELSE true END)
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
