-- Changes a consumer's settings; a NULL argument keeps the current value.
-- Both rows change in one statement, and the statement triggers on both
-- tables send the "c" notification that makes running dispatchers reload.
WITH t AS (
    UPDATE triggers SET
        enabled         = coalesce(@enabled, enabled),
        max_attempts    = coalesce(@max_attempts, max_attempts),
        backoff_base_ms = coalesce(@backoff_base_ms, backoff_base_ms),
        backoff_cap_ms  = coalesce(@backoff_cap_ms, backoff_cap_ms)
    WHERE id = @id AND kind = 'queue' AND app_id = @app_id
    RETURNING id
), d AS (
    UPDATE queue_trigger_details SET
        visibility_timeout_secs = coalesce(@visibility_timeout_secs, visibility_timeout_secs),
        max_in_flight           = coalesce(@max_in_flight, max_in_flight),
        push_url                = coalesce(@push_url, push_url),
        -- 0 resets the push timeout to the default (NULL).
        push_timeout_ms         = CASE WHEN @push_timeout_ms::int = 0 THEN NULL
                                       ELSE coalesce(@push_timeout_ms, push_timeout_ms) END
    WHERE trigger_id = (SELECT id FROM t)
    RETURNING trigger_id
)
SELECT count(*) FROM d
