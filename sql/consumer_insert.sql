-- Inserts a queue consumer: the parent triggers row with the retry policy
-- and its queue_trigger_details, in one statement. Run under
-- consumer_lock.sql after consumer_find.sql found no consumer.
--
-- A push consumer's signing secret (one with a URL; a Go handler's has
-- none, NULL) is made here, by the server, and returned, never sent as a
-- parameter: a server run with log_statement = all or
-- log_min_duration_statement = 0 (as for pgBadger) writes every bind
-- parameter to its log, and a secret sent as one would be in it.
-- bellhop_push_secret (migration 0068) makes it: 64 lowercase hex
-- characters, as the secrets made by earlier versions in Go.
WITH t AS (
    INSERT INTO triggers (app_id, kind, principal_id, enabled, max_attempts, backoff_base_ms, backoff_cap_ms)
    VALUES (@app_id, 'queue', @principal_id, true, @max_attempts, @backoff_base_ms, @backoff_cap_ms)
    RETURNING id, created_at
), d AS (
    INSERT INTO queue_trigger_details (trigger_id, queue_name, visibility_timeout_secs, max_in_flight,
                                       push_url, push_secret, push_timeout_ms)
    SELECT id, @queue_name, @visibility_timeout_secs, @max_in_flight, @push_url::text,
           CASE WHEN @push_url::text IS NOT NULL THEN bellhop_push_secret() END,
           @push_timeout_ms
    FROM t
    RETURNING trigger_id, push_secret
)
SELECT t.id, t.created_at, d.push_secret FROM t JOIN d ON d.trigger_id = t.id
