-- The SECURITY DEFINER functions no longer look up names in schema public.
--
-- Each ran with search_path = public, pg_temp. PostgreSQL resolves a
-- function or operator call among every candidate on the path, and one in
-- public whose argument types fit the call better wins over pg_catalog's,
-- whatever the order of the path. A role that may create in public (a
-- grant, or its ownership: from PostgreSQL 15 the database's owner owns
-- public) could therefore make these functions run its code as their
-- owner. A review planted public.jsonb_path_exists(jsonb, text): every
-- enqueue() by a least-privileged producer then ran it as a superuser,
-- since the call's second argument is a literal, which takes text before
-- jsonpath. make_interval(secs => an integer) in the timeout floors, and
-- any call with a literal or an integer argument, are open the same way.
-- migrate warns of such roles (migrations.PublicCreators) but cannot stop
-- them.
--
-- Now search_path = pg_catalog, pg_temp, and every Bellhop table, view and
-- function these functions use is named public.<name>, as PostgreSQL's
-- manual advises for SECURITY DEFINER functions: a name in public is
-- found only where it is written so, and a table name cannot be taken by
-- another object in the same schema. pg_temp comes last so that no
-- temporary table shadows a catalog one; functions are never looked up in
-- it.
--
-- bellhop_default_max_attempts() is not SECURITY DEFINER, but enqueue()
-- calls it, and a SQL function's body is planned with the caller's
-- search_path; it now names public.queue_consumers. Left without a SET
-- clause, which would stop PostgreSQL from inlining it.
--
-- The bodies are otherwise word for word those of 0065 (enqueue), 0063
-- (bellhop_lease_message), 0054 and 0047 (the timeout floors) and 0039
-- (bellhop_default_max_attempts). CREATE OR REPLACE keeps each function's
-- owner and grants. It can run again, as every migration since 0052 can.
--
-- The statements the Go code sends (sql/) and the trigger functions that
-- run as their caller still use the caller's search_path: they run with
-- the caller's rights, not the owner's.

CREATE OR REPLACE FUNCTION enqueue(
    p_app_id        UUID,
    p_queue_name    TEXT,
    p_payload       JSONB,
    p_deliver_after TIMESTAMPTZ DEFAULT NULL,
    p_max_attempts  INT DEFAULT NULL,
    p_principal     UUID DEFAULT NULL
) RETURNS UUID
-- SECURITY DEFINER, so that a producer role needs only EXECUTE on it (see
-- docs/roles.sql); search_path holds pg_catalog alone (and pg_temp, last,
-- for tables only), so that no role that may create in public can put a
-- function or operator in the way of the owner's calls.
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_id      UUID;
    v_number  JSONB;
    v_printed BIGINT := 0;
    v_seq     BIGINT := coalesce(substring(current_setting('bellhop.enqueue_seq', true) FROM '^[0-9]{1,9}$')::bigint, 0);
BEGIN
    IF p_app_id IS NULL OR NOT EXISTS (SELECT 1 FROM public.apps WHERE id = p_app_id) THEN
        RAISE EXCEPTION 'bellhop: unknown app %', coalesce(p_app_id::text, 'NULL') USING ERRCODE = 'BH001';
    END IF;
    IF p_queue_name IS NULL OR p_queue_name !~ '^[A-Za-z0-9._:-]{1,128}$' THEN
        RAISE EXCEPTION 'bellhop: invalid queue name %', coalesce(to_json(left(p_queue_name, 200))::text, 'NULL')
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
       AND NOT EXISTS (SELECT 1 FROM public.principals WHERE id = p_principal AND app_id = p_app_id) THEN
        RAISE EXCEPTION 'bellhop: principal % does not belong to app %', p_principal, p_app_id USING ERRCODE = 'BH005';
    END IF;

    INSERT INTO public.queue_messages (app_id, queue_name, payload, enqueued_at, deliver_after, max_attempts, enqueued_by_principal)
    VALUES (p_app_id, p_queue_name, p_payload, now() + v_seq * interval '1 microsecond', p_deliver_after,
            coalesce(p_max_attempts, public.bellhop_default_max_attempts(p_app_id, p_queue_name)), p_principal)
    RETURNING id INTO v_id;
    PERFORM set_config('bellhop.enqueue_seq', (v_seq + 1)::text, true);
    RETURN v_id;
END
$$;

CREATE OR REPLACE FUNCTION bellhop_default_max_attempts(p_app_id UUID, p_queue_name TEXT) RETURNS INT
LANGUAGE sql STABLE AS $$
    SELECT coalesce(
        (SELECT max_attempts FROM public.queue_consumers
         WHERE app_id = p_app_id AND queue_name = p_queue_name
         LIMIT 1),
        3)
$$;

CREATE OR REPLACE FUNCTION bellhop_lease_message(p_id UUID, p_app_id UUID, p_queue_name TEXT) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off AS $$
DECLARE
    offer    public.bellhop_offers%ROWTYPE;
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
    FROM public.queue_messages AS q
    WHERE q.id = p_id;
    IF leasable IS NOT TRUE THEN
        RETURN false;
    END IF;
    -- Only an offer whose owner's listener is connected: it holds its
    -- owner key shared (lease_key_hold.sql). Tried exclusively and let go
    -- at once, in one expression, as 0045 tests the lease key.
    SELECT * INTO offer FROM public.bellhop_offers AS o
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
    FROM public.queue_trigger_details AS d
    WHERE d.trigger_id = offer.consumer_id AND d.queue_name = p_queue_name;
    IF vt_secs IS NULL THEN
        RETURN false;
    END IF;
    UPDATE public.queue_messages
    SET claim_token = offer.token, claimed_at = clock_timestamp(), attempt = attempt + 1
    WHERE id = p_id
    RETURNING id, payload::text AS body, attempt, max_attempts, enqueued_at, claimed_at,
              enqueued_by_principal
    INTO m;
    DELETE FROM public.bellhop_offers WHERE token = offer.token;
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

CREATE OR REPLACE FUNCTION bellhop_keep_vt_floor(p_app_id UUID, p_queue_name TEXT, p_vt_secs INT) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT set_config('bellhop.vt_floors_pending', 'on', true);
    INSERT INTO public.bellhop_vt_floors AS f (app_id, queue_name, vt_secs, until)
    VALUES (p_app_id, p_queue_name, p_vt_secs, 'infinity')
    ON CONFLICT (app_id, queue_name) DO UPDATE SET
        vt_secs = CASE WHEN f.until > clock_timestamp() THEN GREATEST(f.vt_secs, EXCLUDED.vt_secs)
                       ELSE EXCLUDED.vt_secs END,
        until   = 'infinity';
$$;

CREATE OR REPLACE FUNCTION bellhop_start_vt_floors() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF current_setting('bellhop.vt_floors_pending', true) IS DISTINCT FROM 'on' THEN
        RETURN NULL;
    END IF;
    PERFORM set_config('bellhop.vt_floors_pending', 'off', true);
    DELETE FROM public.bellhop_vt_floors WHERE until < clock_timestamp() - interval '1 hour';
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION bellhop_start_seen_vt_floors() RETURNS bigint
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    WITH seen AS (
        SELECT app_id, queue_name FROM public.bellhop_vt_floors
        WHERE until = 'infinity'
        FOR UPDATE SKIP LOCKED
    ), started AS (
        UPDATE public.bellhop_vt_floors AS f SET until = clock_timestamp() + make_interval(secs => f.vt_secs + 5)
        FROM seen
        WHERE f.app_id = seen.app_id AND f.queue_name = seen.queue_name AND f.until = 'infinity'
        RETURNING 1
    )
    SELECT count(*) FROM started
$$;

CREATE OR REPLACE FUNCTION bellhop_vt_lowered() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NEW.visibility_timeout_secs < OLD.visibility_timeout_secs
       OR NEW.queue_name IS DISTINCT FROM OLD.queue_name THEN
        PERFORM public.bellhop_keep_vt_floor(t.app_id, OLD.queue_name, OLD.visibility_timeout_secs)
        FROM public.triggers AS t WHERE t.id = OLD.trigger_id;
    END IF;
    IF NEW.queue_name IS DISTINCT FROM OLD.queue_name
       AND NEW.visibility_timeout_secs < OLD.visibility_timeout_secs THEN
        PERFORM public.bellhop_keep_vt_floor(t.app_id, NEW.queue_name, OLD.visibility_timeout_secs)
        FROM public.triggers AS t WHERE t.id = OLD.trigger_id;
    END IF;
    RETURN NEW;
END
$$;

CREATE OR REPLACE FUNCTION bellhop_vt_removed() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM public.bellhop_keep_vt_floor(OLD.app_id, d.queue_name, d.visibility_timeout_secs)
    FROM public.queue_trigger_details AS d WHERE d.trigger_id = OLD.id;
    RETURN OLD;
END
$$;
