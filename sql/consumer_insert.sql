-- Inserts a queue consumer: the parent triggers row with the retry policy
-- and its queue_trigger_details, in one statement. Run under
-- consumer_lock.sql after consumer_find.sql found no consumer.
WITH t AS (
    INSERT INTO triggers (app_id, kind, principal_id, enabled, max_attempts, backoff_base_ms, backoff_cap_ms)
    VALUES (@app_id, 'queue', @principal_id, true, @max_attempts, @backoff_base_ms, @backoff_cap_ms)
    RETURNING id, created_at
), d AS (
    INSERT INTO queue_trigger_details (trigger_id, queue_name, visibility_timeout_secs, max_in_flight,
                                       push_url, push_secret, push_timeout_ms)
    SELECT id, @queue_name, @visibility_timeout_secs, @max_in_flight, @push_url, @push_secret, @push_timeout_ms FROM t
    RETURNING trigger_id
)
SELECT t.id, t.created_at FROM t JOIN d ON d.trigger_id = t.id
