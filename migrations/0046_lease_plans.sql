-- The lease's plans: a producer's lease finds its rows by index, whatever
-- the planner believes about the tables. Two of 0045's plans could read a
-- whole queue, or a whole table, to lease one message:
--
--   * The offer lookup could run as a sequential scan. bellhop_offers
--     churns: a leasing dispatcher inserts an offer for every message and
--     the lease deletes it. Where the statistics say that most offers are
--     of one queue, LIMIT 1 over a sequential scan looks cheapest, and the
--     scan then reads every dead offer that a long transaction's snapshot
--     keeps from being pruned: 100 a second, for as long as that snapshot
--     lives. The index on (app_id, queue_name) reads the entries of one
--     queue.
--   * The UPDATE of the message could go through
--     idx_queue_messages_dispatch, which matches "claim_token IS NULL" and
--     the queue's columns, and filter on id: it then read every unclaimed
--     message of the queue (delayed ones too) and every dead entry of its
--     claimed ones, to find one row the primary key finds directly.
--
-- So the function plans with sequential scans off, and finds the message
-- by its id alone: it locks the row by primary key, checks it, and updates
-- it by primary key. The lock keeps the check and the update one step:
-- under READ COMMITTED an UPDATE that waited for another writer re-checks
-- only its own WHERE clause, which is now just the id. The row is normally
-- the caller's own uncommitted INSERT, which nobody else can see, so the
-- lock waits for nobody. What the function leases, and the notification
-- it sends, are 0045's. Measured in BENCHMARKS.md, "The lease's plans
-- (0046)"; integration/lease_test.go, TestLeasePlans, checks the scans.

CREATE OR REPLACE FUNCTION bellhop_lease_message(p_id UUID, p_app_id UUID, p_queue_name TEXT) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = public, pg_temp
SET enable_seqscan = off AS $$
DECLARE
    offer    bellhop_offers%ROWTYPE;
    leasable boolean;
    m        RECORD;
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
        || ':' || m.body);
    RETURN true;
END
$$;
