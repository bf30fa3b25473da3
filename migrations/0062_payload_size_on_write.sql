-- The 1 MiB payload rule of 0038, checked only when a payload is written,
-- and enqueue() made safe against numbers that print long.
--
-- 1. PostgreSQL checks every CHECK constraint on every UPDATE, whichever
-- columns it sets. So each claim, extend, nack, release and reclaim of a
-- message, and each claim of an invoke delivery, printed its whole payload
-- again to measure it, though the payload cannot have changed. 200
-- messages of 90 KB, one UPDATE setting claim_token and claimed_at: 57 ms
-- with the CHECK, 3.3 ms without (a reviewer measured 2.7 s against 16 ms
-- for a reclaim pass over 150 expired leases, 100 of them of 1 MB).
--
-- The rule is now a BEFORE trigger on INSERT and on UPDATE OF payload,
-- which fires only for a statement that names the payload, and whose WHEN
-- clause does the measuring, so that no function runs for a payload within
-- the limit. The function raises what the CHECK raised: SQLSTATE 23514
-- with the constraint's name, which clients map to their payload error
-- (client.go), without the CHECK's DETAIL, which quoted the whole row.
-- ENABLE ALWAYS: a CHECK holds whatever session_replication_role says,
-- while a trigger is skipped in replica mode unless it is ALWAYS.
--
-- 2. jsonb prints a number in full: 1e131071 is 131,072 digits. enqueue()
-- measured its payload by printing it, so 74 KB of such numbers made the
-- server build a gigabyte for 10 s and fail with "out of memory" (54000)
-- rather than BH003. It now measures first the numbers whose magnitude
-- lets them print long (zeros too, which keep their scale: 0e-16383
-- prints 16,385 characters), one at a time, stopping at the limit; the
-- rest print to at most about 8 times their size in the payload given. A
-- plain INSERT is measured by the trigger's WHEN clause, as by the CHECK
-- before: the same number-by-number walk there would cost every INSERT
-- about 3.5 µs more (README, Security).
--
-- 3. enqueue()'s limit on deliver_after is 87600 hours, as the Go
-- client's, rather than 3650 days: adding days to a timestamptz follows
-- the session's time zone across daylight-saving changes, so the limit was
-- an hour longer or shorter on some dates.
--
-- Otherwise 0058's enqueue(), word for word: CREATE OR REPLACE keeps its
-- owner and grants (EXECUTE revoked from PUBLIC, granted by
-- docs/roles.sql).
--
-- Every statement can run again, as those since 0052 can.

CREATE OR REPLACE FUNCTION bellhop_payload_too_large() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    -- TG_ARGV[0] is the name of the constraint this trigger replaces.
    RAISE EXCEPTION 'new row for relation "%" violates check constraint "%"', TG_TABLE_NAME, TG_ARGV[0]
        USING ERRCODE = 'check_violation', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME,
              CONSTRAINT = TG_ARGV[0],
              DETAIL = 'The payload prints to more than 1048576 bytes.';
END
$$;

ALTER TABLE queue_messages DROP CONSTRAINT IF EXISTS queue_messages_payload_size_check;
CREATE OR REPLACE TRIGGER queue_messages_payload_size
    BEFORE INSERT OR UPDATE OF payload ON queue_messages
    FOR EACH ROW
    WHEN (octet_length(NEW.payload::text) > 1048576)
    EXECUTE FUNCTION bellhop_payload_too_large('queue_messages_payload_size_check');
ALTER TABLE queue_messages ENABLE ALWAYS TRIGGER queue_messages_payload_size;

ALTER TABLE outbox DROP CONSTRAINT IF EXISTS outbox_payload_size_check;
CREATE OR REPLACE TRIGGER outbox_payload_size
    BEFORE INSERT OR UPDATE OF payload ON outbox
    FOR EACH ROW
    WHEN (octet_length(NEW.payload::text) > 1048576)
    EXECUTE FUNCTION bellhop_payload_too_large('outbox_payload_size_check');
ALTER TABLE outbox ENABLE ALWAYS TRIGGER outbox_payload_size;

CREATE OR REPLACE FUNCTION enqueue(
    p_app_id        UUID,
    p_queue_name    TEXT,
    p_payload       JSONB,
    p_deliver_after TIMESTAMPTZ DEFAULT NULL,
    p_max_attempts  INT DEFAULT NULL,
    p_principal     UUID DEFAULT NULL
) RETURNS UUID
-- SECURITY DEFINER, so that a producer role needs only EXECUTE on it (see
-- docs/roles.sql); search_path is pinned so callers cannot redirect the
-- names it uses.
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v_id      UUID;
    v_number  JSONB;
    v_printed BIGINT := 0;
BEGIN
    IF p_app_id IS NULL OR NOT EXISTS (SELECT 1 FROM apps WHERE id = p_app_id) THEN
        RAISE EXCEPTION 'bellhop: unknown app %', coalesce(p_app_id::text, 'NULL') USING ERRCODE = 'BH001';
    END IF;
    IF p_queue_name IS NULL OR p_queue_name !~ '^[A-Za-z0-9._:-]{1,128}$' THEN
        RAISE EXCEPTION 'bellhop: invalid queue name %', coalesce(quote_literal(left(p_queue_name, 200)), 'NULL')
            USING ERRCODE = 'BH002', HINT = 'a queue name is 1 to 128 bytes of [A-Za-z0-9._:-]';
    END IF;
    IF p_payload IS NULL THEN
        RAISE EXCEPTION 'bellhop: payload is NULL; send a JSON value (JSON null is ''null''::jsonb)' USING ERRCODE = 'BH003';
    END IF;
    -- Numbers of magnitude 1e30 or more, or below 1e-30, print to 31
    -- characters or more however short they were written; so may a zero,
    -- which keeps its scale (0e-16383 prints 16,385 characters). The
    -- test for any comes first: a loop over a query costs a payload
    -- without them several times what the test does.
    IF jsonb_path_exists(p_payload, 'strict $.** ? (@.type() == "number" && (@ >= 1e30 || @ <= -1e30 || (@ < 1e-30 && @ > -1e-30)))') THEN
        FOR v_number IN
            SELECT jsonb_path_query(p_payload,
                'strict $.** ? (@.type() == "number" && (@ >= 1e30 || @ <= -1e30 || (@ < 1e-30 && @ > -1e-30)))')
        LOOP
            v_printed := v_printed + octet_length(v_number::text);
            IF v_printed > 1048576 THEN
                RAISE EXCEPTION 'bellhop: payload''s numbers alone print to more than the 1048576-byte limit'
                    USING ERRCODE = 'BH003', HINT = 'PostgreSQL prints a JSON number in full: 1e6 is 1000000';
            END IF;
        END LOOP;
    END IF;
    IF octet_length(p_payload::text) > 1048576 THEN
        RAISE EXCEPTION 'bellhop: payload is % bytes, more than the 1048576-byte limit', octet_length(p_payload::text)
            USING ERRCODE = 'BH003';
    END IF;
    IF NOT isfinite(p_deliver_after) THEN
        RAISE EXCEPTION 'bellhop: deliver_after % is not a finite time', p_deliver_after USING ERRCODE = 'BH004',
            HINT = 'give a time at most 87600 hours ahead, or NULL to deliver now';
    END IF;
    IF p_deliver_after > now() + interval '87600 hours' THEN
        RAISE EXCEPTION 'bellhop: deliver_after % is more than 87600 hours ahead', p_deliver_after USING ERRCODE = 'BH004';
    END IF;
    IF p_max_attempts IS NOT NULL AND (p_max_attempts < 1 OR p_max_attempts > 1000) THEN
        RAISE EXCEPTION 'bellhop: max_attempts % is outside 1..1000', p_max_attempts USING ERRCODE = 'BH004';
    END IF;
    IF p_principal IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM principals WHERE id = p_principal AND app_id = p_app_id) THEN
        RAISE EXCEPTION 'bellhop: principal % does not belong to app %', p_principal, p_app_id USING ERRCODE = 'BH005';
    END IF;

    INSERT INTO queue_messages (app_id, queue_name, payload, deliver_after, max_attempts, enqueued_by_principal)
    VALUES (p_app_id, p_queue_name, p_payload, p_deliver_after,
            coalesce(p_max_attempts, bellhop_default_max_attempts(p_app_id, p_queue_name)), p_principal)
    RETURNING id INTO v_id;
    RETURN v_id;
END
$$;
