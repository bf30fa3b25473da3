-- Leasing at INSERT: an idle dispatcher's offer lets the producer lease the
-- new message to it in the producer's own transaction, so the dispatcher
-- starts the handler when the notification arrives, without a claim round
-- trip (docs/lease-at-insert.md). Dispatchers opt in with
-- DispatcherConfig.LeaseAtInsert; without offers the trigger behaves as in
-- 0043.
--
-- An offer says "the next ready message of this queue may be leased to me
-- under this token". The dispatcher picks the token (it becomes the
-- message's claim_token) and a channel name that only it and this table
-- know: the lease's notification carries the payload, and LISTEN needs the
-- channel's name, so roles that cannot read this table cannot read it.
--
-- UNLOGGED: an offer is a hint, not data. A crash that empties the table
-- only sends producers back to the q: notification, and the dispatchers
-- make new offers once theirs have expired.
CREATE UNLOGGED TABLE bellhop_offers (
    token       UUID PRIMARY KEY,
    app_id      UUID NOT NULL,
    queue_name  TEXT NOT NULL,
    owner       UUID NOT NULL,
    channel     TEXT NOT NULL,
    -- The poll of the owning dispatcher extends it; an offer of a crashed
    -- dispatcher dies with it.
    expires_at  TIMESTAMPTZ NOT NULL
);

CREATE INDEX bellhop_offers_queue ON bellhop_offers (app_id, queue_name);
CREATE INDEX bellhop_offers_owner ON bellhop_offers (owner);

REVOKE ALL ON bellhop_offers FROM PUBLIC;

-- The notify trigger becomes a deferred constraint trigger: its WHEN clause,
-- 0043's busy-mark test, still runs as each row is inserted (PostgreSQL
-- evaluates a constraint trigger's WHEN at once, and queues the trigger
-- only if it holds), but the function runs at COMMIT. So a lease starts
-- when the message is committed, not when it was inserted into a
-- transaction that may stay open for longer than the visibility timeout,
-- and an offer is locked only for the commit, not for the transaction.
-- The notification is sent at commit either way. SET CONSTRAINTS ...
-- IMMEDIATE runs it at the end of the statement instead, as before.
--
-- The function runs only when the WHEN clause found no dispatcher
-- draining the queue, so producers of a busy queue pay nothing more.
--
-- Under READ COMMITTED, with a live offer of the queue and the row still
-- ready (no future deliver_after, not claimed) and small enough for a
-- notification, it leases the row under the offer's token: claim_token,
-- claimed_at = clock_timestamp() and attempt + 1, as claim_queue.sql does,
-- and sends
--   l:<token>:<id>:<attempt>:<max_attempts>:<enqueued_at µs>:<claimed_at µs>:<principal>:<payload>
-- on the offer's channel instead of q: on 'bellhop'. Otherwise it sends q:
-- as before. Other isolation levels never lease: their snapshot may
-- predate an offer's last extension, and locking such a row fails the
-- producer's transaction with a serialization error.
--
-- Safe under concurrency:
--   * SKIP LOCKED: producers never wait for each other's offers, nor for a
--     dispatcher withdrawing one; an offer is taken by one transaction
--     only, and a rollback gives it back with the row and the notification.
--   * The lease is written before the row is visible to anyone: no claim
--     can see the row without its claim_token.
--   * A lease whose notification is lost ends like any other: its
--     dispatcher finds it by token on its next poll or reconnect, or the
--     reclaim returns it after the visibility timeout.
--
-- SECURITY DEFINER, with a pinned search_path: producers need no rights on
-- bellhop_offers, and may not UPDATE queue_messages themselves.
CREATE OR REPLACE FUNCTION bellhop_notify_queue_message() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    offer bellhop_offers%ROWTYPE;
    m     RECORD;
BEGIN
    IF NEW.claim_token IS NULL AND (NEW.deliver_after IS NULL OR NEW.deliver_after <= clock_timestamp())
       AND current_setting('transaction_isolation') = 'read committed' THEN
        SELECT * INTO offer FROM bellhop_offers
        WHERE app_id = NEW.app_id AND queue_name = NEW.queue_name AND expires_at > clock_timestamp()
        LIMIT 1
        FOR UPDATE SKIP LOCKED;
        IF FOUND THEN
            -- The row as it is now: the transaction may have changed it
            -- since the INSERT. A notification holds under 8000 bytes and
            -- the header takes under 200; a larger payload leaves the
            -- offer for a smaller message.
            UPDATE queue_messages
            SET claim_token = offer.token, claimed_at = clock_timestamp(), attempt = attempt + 1
            WHERE id = NEW.id AND claim_token IS NULL
              AND (deliver_after IS NULL OR deliver_after <= clock_timestamp())
              AND octet_length(payload::text) <= 7600
            RETURNING id, payload::text AS body, attempt, max_attempts, enqueued_at, claimed_at,
                      enqueued_by_principal
            INTO m;
            IF FOUND THEN
                DELETE FROM bellhop_offers WHERE token = offer.token;
                PERFORM pg_notify(offer.channel, 'l:' || offer.token::text || ':' || m.id::text
                    || ':' || m.attempt::text || ':' || m.max_attempts::text
                    || ':' || (extract(epoch FROM m.enqueued_at) * 1000000)::bigint::text
                    || ':' || (extract(epoch FROM m.claimed_at) * 1000000)::bigint::text
                    || ':' || coalesce(m.enqueued_by_principal::text, '')
                    || ':' || m.body);
                RETURN NULL;
            END IF;
        END IF;
    END IF;
    PERFORM pg_notify('bellhop', 'q:' || NEW.app_id::text || ':' || NEW.queue_name);
    RETURN NULL;
END
$$;

DROP TRIGGER queue_messages_notify ON queue_messages;

CREATE CONSTRAINT TRIGGER queue_messages_notify
    AFTER INSERT ON queue_messages
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (CASE
          WHEN pg_advisory_xact_lock_shared(1650814061, hashtext(NEW.app_id::text || ':' || NEW.queue_name)) IS NULL
              THEN false -- never: the lock returns void
          WHEN pg_try_advisory_lock_shared(1650814062, hashtext(NEW.app_id::text || ':' || NEW.queue_name))
              THEN pg_advisory_unlock_shared(1650814062, hashtext(NEW.app_id::text || ':' || NEW.queue_name))
          ELSE false
          END)
    EXECUTE FUNCTION bellhop_notify_queue_message();
