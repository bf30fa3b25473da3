-- One queue consumer by id, with its app's name, or by (app name, queue).
-- Its secrets, as in consumer_list.sql, only with with_secret.
SELECT c.id, c.app_id, c.app_name, c.queue_name, c.principal_id, c.enabled, c.max_attempts, c.backoff_base_ms,
       c.backoff_cap_ms, c.visibility_timeout_secs, c.max_in_flight, c.created_at, c.last_fired_at,
       c.push_url, c.push_timeout_ms, CASE WHEN @with_secret::bool THEN c.push_secret END,
       CASE WHEN @with_secret::bool AND d.push_secret_previous_until > now() THEN d.push_secret_previous END,
       CASE WHEN d.push_secret_previous_until > now() THEN d.push_secret_previous_until END
FROM queue_consumers AS c
-- The rotation's columns (0068), which the view does not carry.
JOIN queue_trigger_details AS d ON d.trigger_id = c.id
WHERE c.id = @id OR (c.app_name = @app_name AND c.queue_name = @queue_name)
