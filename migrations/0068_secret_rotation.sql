-- Push secrets can be rotated without replacing the consumer.
--
-- Until now a push consumer's signing secret was replaced by removing the
-- consumer and registering it again, which gave it a new id and default
-- settings, deleted its pending invoke deliveries, and left a gap in which
-- its receiver refused every request signed with the secret it did not
-- have yet. A rotation (sql/consumer_rotate_secret.sql) now gives the
-- consumer a new secret and keeps the one it replaces in
-- push_secret_previous until push_secret_previous_until; dispatchers sign
-- each request with both until then (Bellhop-Signature: v1=<new>,v1=<old>),
-- so that receivers can move to the new secret at their own pace.
--
-- bellhop_push_secret() makes a secret as registration has made them since
-- consumer_insert.sql took it over: 64 lowercase hex characters, the
-- SHA-256 of two version 4 UUIDs (about 244 random bits from
-- pg_strong_random, with no extension needed). It is made in the server,
-- so that it is never a statement's parameter, which a server that logs
-- parameters would write to its log. The built-ins are named with their
-- schema, as the function runs under its caller's search_path.
--
-- Rotating changes push_secret, so its UPDATE sends the notification that
-- makes running dispatchers reload their consumers (0040's trigger).
-- queue_consumers gains the two columns at its end. It can run again, as
-- every migration since 0052 can.

ALTER TABLE queue_trigger_details
    ADD COLUMN IF NOT EXISTS push_secret_previous TEXT NULL,
    ADD COLUMN IF NOT EXISTS push_secret_previous_until TIMESTAMPTZ NULL;

ALTER TABLE queue_trigger_details DROP CONSTRAINT IF EXISTS queue_trigger_details_push_secret_previous_check;
ALTER TABLE queue_trigger_details ADD CONSTRAINT queue_trigger_details_push_secret_previous_check
    CHECK ((push_secret_previous IS NULL) = (push_secret_previous_until IS NULL)
           AND (push_secret_previous IS NULL OR push_secret IS NOT NULL));

CREATE OR REPLACE FUNCTION bellhop_push_secret() RETURNS TEXT
    LANGUAGE sql VOLATILE
AS $$
    SELECT pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(
        pg_catalog.gen_random_uuid()::text || pg_catalog.gen_random_uuid()::text, 'UTF8')), 'hex')
$$;

CREATE OR REPLACE VIEW queue_consumers AS
SELECT t.id, t.app_id, a.name AS app_name, d.queue_name, t.principal_id, t.enabled,
       t.max_attempts, t.backoff_base_ms, t.backoff_cap_ms,
       d.visibility_timeout_secs, d.max_in_flight, t.created_at, d.last_fired_at,
       d.push_url, d.push_secret, d.push_timeout_ms,
       d.push_secret_previous, d.push_secret_previous_until
FROM triggers t
JOIN queue_trigger_details d ON d.trigger_id = t.id
JOIN apps a ON a.id = t.app_id
WHERE t.kind = 'queue';
