-- SQL helpers for producers, dashboards and dispatchers.

-- Queue consumers with their settings: the parent triggers row, its
-- queue_trigger_details and the app's name.
CREATE VIEW queue_consumers AS
SELECT t.id, t.app_id, a.name AS app_name, d.queue_name, t.principal_id, t.enabled,
       t.max_attempts, t.backoff_base_ms, t.backoff_cap_ms,
       d.visibility_timeout_secs, d.max_in_flight, t.created_at, d.last_fired_at
FROM triggers t
JOIN queue_trigger_details d ON d.trigger_id = t.id
JOIN apps a ON a.id = t.app_id
WHERE t.kind = 'queue';

-- When the next live lease expires, across queue_messages and outbox, or
-- NULL when nothing is in flight. A queue without a consumer uses
-- p_default_vt_secs. It reads only claimed rows (through the claimed_at
-- partial indexes), which are bounded by the dispatchers' max in-flight.
CREATE FUNCTION bellhop_next_lease_expiry(p_default_vt_secs INT) RETURNS TIMESTAMPTZ
LANGUAGE sql STABLE AS $$
    SELECT least(
        (SELECT min(m.claimed_at + make_interval(secs => coalesce(c.visibility_timeout_secs, p_default_vt_secs)))
         FROM queue_messages m
         LEFT JOIN queue_consumers c ON c.app_id = m.app_id AND c.queue_name = m.queue_name
         WHERE m.claim_token IS NOT NULL),
        (SELECT min(m.claimed_at + make_interval(secs => coalesce(c.visibility_timeout_secs, p_default_vt_secs)))
         FROM outbox m
         LEFT JOIN queue_consumers c ON c.id = m.trigger_id
         WHERE m.claim_token IS NOT NULL))
$$;


-- depth counts every message in a queue: ready, delayed and in flight.
CREATE FUNCTION depth(p_app_id UUID, p_queue_name TEXT) RETURNS BIGINT
LANGUAGE sql STABLE AS $$
    SELECT count(*) FROM queue_messages
    WHERE app_id = p_app_id AND queue_name = p_queue_name
$$;

-- depth_pending counts the messages a dispatcher could claim now.
CREATE FUNCTION depth_pending(p_app_id UUID, p_queue_name TEXT) RETURNS BIGINT
LANGUAGE sql STABLE AS $$
    SELECT count(*) FROM queue_messages
    WHERE app_id = p_app_id AND queue_name = p_queue_name
      AND claim_token IS NULL
      AND (deliver_after IS NULL OR deliver_after <= now())
$$;

-- The max_attempts a message gets when its producer does not choose one:
-- the queue consumer's retry policy if the queue has a consumer, else the
-- seed's column default, 3.
CREATE FUNCTION bellhop_default_max_attempts(p_app_id UUID, p_queue_name TEXT) RETURNS INT
LANGUAGE sql STABLE AS $$
    SELECT coalesce(
        (SELECT max_attempts FROM queue_consumers
         WHERE app_id = p_app_id AND queue_name = p_queue_name
         LIMIT 1),
        3)
$$;

-- enqueue validates one message, fills in defaults and inserts it. It is
-- the producer contract for any language; a plain INSERT INTO
-- queue_messages works too and is checked by the same table constraints.
-- Errors carry SQLSTATEs of class BH:
--   BH001 unknown app, BH002 invalid queue name, BH003 invalid payload,
--   BH004 invalid option (max_attempts outside 1..1000, deliver_after more
--   than 3650 days ahead), BH005 principal not of this app.
CREATE FUNCTION enqueue(
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

REVOKE EXECUTE ON FUNCTION enqueue(UUID, TEXT, JSONB, TIMESTAMPTZ, INT, UUID) FROM PUBLIC;

-- One row per (app, queue) that has messages, dead letters or a consumer.
CREATE VIEW queue_list AS
WITH live AS (
    SELECT app_id, queue_name,
           count(*) FILTER (WHERE claim_token IS NULL AND (deliver_after IS NULL OR deliver_after <= now())) AS ready,
           count(*) FILTER (WHERE claim_token IS NULL AND deliver_after > now()) AS delayed,
           count(*) FILTER (WHERE claim_token IS NOT NULL) AS in_flight,
           -- A message is ready from the later of its enqueue and its deliver_after.
           min(greatest(enqueued_at, deliver_after))
               FILTER (WHERE claim_token IS NULL AND (deliver_after IS NULL OR deliver_after <= now())) AS oldest_ready_at
    FROM queue_messages
    GROUP BY app_id, queue_name
), dead AS (
    SELECT app_id, queue_name, count(*) AS dead
    FROM dead_letters WHERE source = 'queue'
    GROUP BY app_id, queue_name
), consumer AS (
    SELECT app_id, queue_name, id AS consumer_id, enabled FROM queue_consumers
), queues AS (
    SELECT app_id, queue_name FROM live
    UNION SELECT app_id, queue_name FROM dead
    UNION SELECT app_id, queue_name FROM consumer
)
SELECT a.name AS app_name,
       q.app_id,
       q.queue_name,
       coalesce(l.ready, 0) AS ready,
       coalesce(l.delayed, 0) AS delayed,
       coalesce(l.in_flight, 0) AS in_flight,
       coalesce(d.dead, 0) AS dead,
       now() - l.oldest_ready_at AS oldest_ready_age,
       c.consumer_id,
       c.enabled AS consumer_enabled
FROM queues q
JOIN apps a ON a.id = q.app_id
LEFT JOIN live l ON l.app_id = q.app_id AND l.queue_name = q.queue_name
LEFT JOIN dead d ON d.app_id = q.app_id AND d.queue_name = q.queue_name
LEFT JOIN consumer c ON c.app_id = q.app_id AND c.queue_name = q.queue_name;

-- Running dispatchers learn of consumer changes from a "c" notification
-- and reload their consumer list. last_fired_at is not a change: it is
-- written by the dispatchers themselves.
CREATE FUNCTION bellhop_notify_consumers() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('bellhop', 'c');
    RETURN NULL;
END
$$;

CREATE TRIGGER triggers_notify_consumers
    AFTER INSERT OR UPDATE OR DELETE ON triggers
    FOR EACH STATEMENT EXECUTE FUNCTION bellhop_notify_consumers();

CREATE TRIGGER queue_trigger_details_notify_consumers
    AFTER INSERT OR DELETE OR UPDATE OF queue_name, visibility_timeout_secs, max_in_flight ON queue_trigger_details
    FOR EACH STATEMENT EXECUTE FUNCTION bellhop_notify_consumers();
