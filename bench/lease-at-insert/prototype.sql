-- A prototype of leasing at INSERT, for bench/lease-at-insert only: it
-- measures what the design in docs/lease-at-insert.md would save, and is
-- not part of Bellhop's schema. main.go installs it in a scratch database
-- and removes it when it ends.
--
-- proto_lease_offer holds offers: "this idle dispatcher takes the next
-- message of this queue". The token becomes the message's claim_token, so
-- the dispatcher that made the offer recognises its lease.
CREATE UNLOGGED TABLE proto_lease_offer (
    token       UUID PRIMARY KEY,
    app_id      UUID NOT NULL,
    queue_name  TEXT NOT NULL,
    lease_until TIMESTAMPTZ NOT NULL
);
CREATE INDEX proto_lease_offer_queue ON proto_lease_offer (app_id, queue_name);

-- Bellhop's notify trigger (migrations/0041_busy_marks.sql), plus: when
-- it would notify, it first takes one live offer of the queue (SKIP
-- LOCKED: producers never wait for each other), leases the statement's
-- oldest ready message of the queue under the offer's token, and sends
-- the lease and the payload in the notification instead of "q:". The
-- real design also needs the payload-size limit of NOTIFY (8000 bytes),
-- the other rows of a multi-row INSERT, and the message's remaining
-- columns; the prototype sends only what the measurement checks.
CREATE FUNCTION proto_lease_notify() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    r RECORD;
    tok UUID;
    mid UUID;
    matt INT;
    mpay JSONB;
BEGIN
    FOR r IN SELECT DISTINCT app_id, queue_name FROM new_messages ORDER BY app_id, queue_name LOOP
        PERFORM pg_advisory_xact_lock_shared(1650814061, hashtext(r.app_id::text || ':' || r.queue_name));
        IF current_setting('transaction_isolation') <> 'read committed'
           OR NOT EXISTS (SELECT 1 FROM queue_busy b
                          WHERE b.app_id = r.app_id AND b.queue_name = r.queue_name
                            AND b.lease_until > clock_timestamp()) THEN
            DELETE FROM proto_lease_offer o
            WHERE o.token = (SELECT f.token FROM proto_lease_offer f
                             WHERE f.app_id = r.app_id AND f.queue_name = r.queue_name
                               AND f.lease_until > clock_timestamp()
                             LIMIT 1 FOR UPDATE SKIP LOCKED)
            RETURNING o.token INTO tok;
            IF tok IS NOT NULL THEN
                UPDATE queue_messages q
                SET claim_token = tok, claimed_at = clock_timestamp(), attempt = q.attempt + 1
                WHERE q.id = (SELECT n.id FROM new_messages n
                              WHERE n.app_id = r.app_id AND n.queue_name = r.queue_name
                                AND (n.deliver_after IS NULL OR n.deliver_after <= now())
                              ORDER BY n.enqueued_at LIMIT 1)
                RETURNING q.id, q.attempt, q.payload INTO mid, matt, mpay;
                PERFORM pg_notify('bellhop', 'l:' || tok::text || ':' || mid::text || ':' || matt || ':' || mpay::text);
            ELSE
                PERFORM pg_notify('bellhop', 'q:' || r.app_id::text || ':' || r.queue_name);
            END IF;
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;

CREATE TRIGGER proto_lease AFTER INSERT ON queue_messages
    REFERENCING NEW TABLE AS new_messages
    FOR EACH STATEMENT EXECUTE FUNCTION proto_lease_notify();
ALTER TABLE queue_messages DISABLE TRIGGER proto_lease;
