-- HTTP push consumers: the daemon POSTs each message to push_url, signed
-- with push_secret (HMAC-SHA256), and gives up on a request after
-- push_timeout_ms. All three are NULL for consumers served by Go handlers.
ALTER TABLE queue_trigger_details
    ADD COLUMN push_url TEXT NULL
        CONSTRAINT queue_trigger_details_push_url_check
        CHECK (push_url IS NULL OR (push_url ~ '^https?://' AND octet_length(push_url) <= 2048)),
    ADD COLUMN push_secret TEXT NULL,
    ADD COLUMN push_timeout_ms INT NULL
        CONSTRAINT queue_trigger_details_push_timeout_check
        CHECK (push_timeout_ms IS NULL OR push_timeout_ms BETWEEN 100 AND 43200000);

CREATE OR REPLACE VIEW queue_consumers AS
SELECT t.id, t.app_id, a.name AS app_name, d.queue_name, t.principal_id, t.enabled,
       t.max_attempts, t.backoff_base_ms, t.backoff_cap_ms,
       d.visibility_timeout_secs, d.max_in_flight, t.created_at, d.last_fired_at,
       d.push_url, d.push_secret, d.push_timeout_ms
FROM triggers t
JOIN queue_trigger_details d ON d.trigger_id = t.id
JOIN apps a ON a.id = t.app_id
WHERE t.kind = 'queue';

DROP TRIGGER queue_trigger_details_notify_consumers ON queue_trigger_details;
CREATE TRIGGER queue_trigger_details_notify_consumers
    AFTER INSERT OR DELETE
       OR UPDATE OF queue_name, visibility_timeout_secs, max_in_flight, push_url, push_secret, push_timeout_ms
    ON queue_trigger_details
    FOR EACH STATEMENT EXECUTE FUNCTION bellhop_notify_consumers();
