-- The second prototype of leasing at INSERT (main.go -variant before):
-- the same offers as prototype.sql, but the lease is written into the new
-- row by a BEFORE row trigger instead of by an UPDATE after the INSERT, so
-- the message gets one tuple version, not two. A transaction-local setting
-- in the WHEN clause makes the trigger run for the first row of a
-- transaction only: a bulk INSERT pays one function call, not one per row.
-- The AFTER statement trigger then announces the leased row with "l:", or
-- the queue with "q:" as Bellhop's trigger does. Only for bench/lease-at-
-- insert; a real design must also announce the other rows of a multi-row
-- INSERT, and handle INSERT ... ON CONFLICT DO NOTHING, which can drop a
-- row the BEFORE trigger already leased.
CREATE UNLOGGED TABLE proto_lease_offer (
    token       UUID PRIMARY KEY,
    app_id      UUID NOT NULL,
    queue_name  TEXT NOT NULL,
    lease_until TIMESTAMPTZ NOT NULL
);
CREATE INDEX proto_lease_offer_queue ON proto_lease_offer (app_id, queue_name);

CREATE FUNCTION proto_lease_before() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    tok UUID;
BEGIN
    PERFORM set_config('bellhop.lease_tried', 'y', true);
    PERFORM pg_advisory_xact_lock_shared(1650814061, hashtext(NEW.app_id::text || ':' || NEW.queue_name));
    IF NOT EXISTS (SELECT 1 FROM queue_busy b WHERE b.app_id = NEW.app_id AND b.queue_name = NEW.queue_name
                     AND b.lease_until > clock_timestamp()) THEN
        DELETE FROM proto_lease_offer o
        WHERE o.token = (SELECT f.token FROM proto_lease_offer f
                         WHERE f.app_id = NEW.app_id AND f.queue_name = NEW.queue_name
                           AND f.lease_until > clock_timestamp()
                         LIMIT 1 FOR UPDATE SKIP LOCKED)
        RETURNING o.token INTO tok;
        IF tok IS NOT NULL THEN
            NEW.claim_token := tok;
            NEW.claimed_at := clock_timestamp();
            NEW.attempt := NEW.attempt + 1;
        END IF;
    END IF;
    RETURN NEW;
END $$;
CREATE FUNCTION proto_lease_notify() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    r RECORD;
    m RECORD;
BEGIN
    FOR r IN SELECT DISTINCT app_id, queue_name FROM new_messages ORDER BY app_id, queue_name LOOP
        PERFORM pg_advisory_xact_lock_shared(1650814061, hashtext(r.app_id::text || ':' || r.queue_name));
        SELECT n.id, n.attempt, n.payload, n.claim_token INTO m FROM new_messages n
          WHERE n.app_id = r.app_id AND n.queue_name = r.queue_name AND n.claim_token IS NOT NULL LIMIT 1;
        IF m.id IS NOT NULL THEN
            PERFORM pg_notify('bellhop', 'l:' || m.claim_token::text || ':' || m.id::text || ':' || m.attempt || ':' || m.payload::text);
        ELSIF current_setting('transaction_isolation') <> 'read committed'
           OR NOT EXISTS (SELECT 1 FROM queue_busy b
                          WHERE b.app_id = r.app_id AND b.queue_name = r.queue_name
                            AND b.lease_until > clock_timestamp()) THEN
            PERFORM pg_notify('bellhop', 'q:' || r.app_id::text || ':' || r.queue_name);
        END IF;
    END LOOP;
    RETURN NULL;
END $$;
CREATE TRIGGER proto_lease AFTER INSERT ON queue_messages
    REFERENCING NEW TABLE AS new_messages
    FOR EACH STATEMENT EXECUTE FUNCTION proto_lease_notify();
CREATE TRIGGER proto_lease_b BEFORE INSERT ON queue_messages FOR EACH ROW
    WHEN (NEW.claim_token IS NULL AND NEW.deliver_after IS NULL AND current_setting('bellhop.lease_tried', true) IS DISTINCT FROM 'y')
    EXECUTE FUNCTION proto_lease_before();
ALTER TABLE queue_messages DISABLE TRIGGER proto_lease;
ALTER TABLE queue_messages DISABLE TRIGGER proto_lease_b;
