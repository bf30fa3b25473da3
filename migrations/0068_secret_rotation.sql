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
--
-- The view queue_consumers is left as it is: the statements that read the
-- new columns join them (consumer_list.sql). Replacing the view too would
-- lock it after the table, the other order from the queries that read the
-- table through it (enqueue, the poll), which could deadlock with them.
-- The one lock taken, ACCESS EXCLUSIVE on queue_trigger_details, holds
-- those queries back for as long as checking the constraint on every
-- consumer takes. It can run again, as every migration since 0052 can.

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
