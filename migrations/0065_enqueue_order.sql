-- Messages enqueued in one transaction keep the order of their calls.
--
-- A message's enqueued_at was its transaction's start, now(), plus its
-- position in its batch (sql/enqueue.sql): the messages of separate
-- statements of one transaction shared their times, position by position.
-- A claim takes the oldest first and ties in heap order, so the batches of
-- the CLI's stream (`bellhop enqueue -`, 500 lines a batch, one
-- transaction) reached a consumer as lines 1, 501, 1001, 2, 502, ...;
-- calls of EnqueueTx, or of enqueue(), in a loop came in any order.
--
-- The Go client's statements (sql/enqueue.sql, sql/enqueue_one.sql) and
-- enqueue() now count, in the setting bellhop.enqueue_seq, local to the
-- transaction, the messages the transaction has enqueued through them, and
-- add that count in microseconds to each message's enqueued_at. A plain
-- INSERT still takes the column's default, now(), and does not count.
-- A value of the setting that is not a count of at most nine digits reads
-- as 0: a producer that sets it can only make its own messages later, by
-- about 17 minutes at most.
--
-- The queue-name error of enqueue() prints the name as a JSON string, so
-- that a control character in it shows escaped ("q1\n") rather than
-- breaking the message's line.
--
-- Otherwise 0062's enqueue(), word for word: CREATE OR REPLACE keeps its
-- owner and grants (EXECUTE revoked from PUBLIC, granted by
-- docs/roles.sql). It can run again, as every migration since 0052 can.

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
    v_seq     BIGINT := coalesce(substring(current_setting('bellhop.enqueue_seq', true) FROM '^[0-9]{1,9}$')::bigint, 0);
BEGIN
    IF p_app_id IS NULL OR NOT EXISTS (SELECT 1 FROM apps WHERE id = p_app_id) THEN
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
       AND NOT EXISTS (SELECT 1 FROM principals WHERE id = p_principal AND app_id = p_app_id) THEN
        RAISE EXCEPTION 'bellhop: principal % does not belong to app %', p_principal, p_app_id USING ERRCODE = 'BH005';
    END IF;

    INSERT INTO queue_messages (app_id, queue_name, payload, enqueued_at, deliver_after, max_attempts, enqueued_by_principal)
    VALUES (p_app_id, p_queue_name, p_payload, now() + v_seq * interval '1 microsecond', p_deliver_after,
            coalesce(p_max_attempts, bellhop_default_max_attempts(p_app_id, p_queue_name)), p_principal)
    RETURNING id INTO v_id;
    PERFORM set_config('bellhop.enqueue_seq', (v_seq + 1)::text, true);
    RETURN v_id;
END
$$;
