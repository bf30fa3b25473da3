-- Queue consumers, optionally of one app, by app and queue name. The
-- signing secret is read only for dispatchers (with_secret), never for listings;
-- so is the previous one (0068), while it still signs.
SELECT id, app_id, app_name, queue_name, principal_id, enabled, max_attempts, backoff_base_ms,
       backoff_cap_ms, visibility_timeout_secs, max_in_flight, created_at, last_fired_at,
       push_url, push_timeout_ms, CASE WHEN @with_secret::bool THEN push_secret END,
       CASE WHEN @with_secret::bool AND push_secret_previous_until > now() THEN push_secret_previous END,
       CASE WHEN push_secret_previous_until > now() THEN push_secret_previous_until END
FROM queue_consumers
WHERE @app_name::text IS NULL OR app_name = @app_name
ORDER BY app_name, queue_name
