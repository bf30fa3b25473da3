-- Dead letters of one app, optionally of one queue, newest first.
SELECT d.id, d.source, a.name, d.queue_name, d.trigger_id, d.payload, d.enqueued_at,
       d.deliver_after, d.attempt, d.max_attempts, d.enqueued_by_principal, d.last_error, d.died_at
FROM dead_letters d JOIN apps a ON a.id = d.app_id
WHERE (@app_name::text IS NULL OR a.name = @app_name)
  AND (@queue_name::text IS NULL OR d.queue_name = @queue_name)
  AND (@id::uuid IS NULL OR d.id = @id)
ORDER BY d.died_at DESC, d.id
LIMIT @max_rows
