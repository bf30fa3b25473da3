-- Queue consumers, optionally of one app, by app and queue name. The
-- signing secret is read only for dispatchers (with_secret), never for listings;
-- so is the previous one (0068), while it still signs.
SELECT c.id, c.app_id, c.app_name, c.queue_name, c.principal_id, c.enabled, c.max_attempts, c.backoff_base_ms,
       c.backoff_cap_ms, c.visibility_timeout_secs, c.max_in_flight, c.created_at, c.last_fired_at,
       c.push_url, c.push_timeout_ms, CASE WHEN @with_secret::bool THEN c.push_secret END,
       CASE WHEN @with_secret::bool AND d.push_secret_previous_until > now() THEN d.push_secret_previous END,
       CASE WHEN d.push_secret_previous_until > now() THEN d.push_secret_previous_until END
FROM queue_consumers AS c
-- The rotation's columns (0068), which the view does not carry.
JOIN queue_trigger_details AS d ON d.trigger_id = c.id
WHERE @app_name::text IS NULL OR c.app_name = @app_name
ORDER BY c.app_name, c.queue_name
