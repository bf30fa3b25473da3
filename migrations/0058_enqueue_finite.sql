-- enqueue() refuses a deliver_after that is not finite with its own error,
-- BH004. 'infinity' was refused already, as more than 3650 days ahead, but
-- '-infinity' passed the function's checks and failed on the table's
-- constraint (0056, queue_messages_deliver_after_finite_check): SQLSTATE
-- 23514, not the BH class that enqueue() documents for its errors. Its
-- errors are now 0039's, with BH004 also for a deliver_after that is not
-- finite.
--
-- Otherwise 0039's function, word for word: CREATE OR REPLACE keeps its
-- owner and grants (EXECUTE revoked from PUBLIC, granted by
-- docs/roles.sql).
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
    v_id UUID;
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
    IF octet_length(p_payload::text) > 1048576 THEN
        RAISE EXCEPTION 'bellhop: payload is % bytes, more than the 1048576-byte limit', octet_length(p_payload::text)
            USING ERRCODE = 'BH003';
    END IF;
    IF NOT isfinite(p_deliver_after) THEN
        RAISE EXCEPTION 'bellhop: deliver_after % is not a finite time', p_deliver_after USING ERRCODE = 'BH004',
            HINT = 'give a time at most 3650 days ahead, or NULL to deliver now';
    END IF;
    IF p_deliver_after > now() + interval '3650 days' THEN
        RAISE EXCEPTION 'bellhop: deliver_after % is more than 3650 days ahead', p_deliver_after USING ERRCODE = 'BH004';
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
