-- Deletes dead letters for good: by id, or every one of an app's queue.
DELETE FROM dead_letters d
USING apps a
WHERE a.id = d.app_id AND a.name = @app_name
  AND (@id::uuid IS NULL OR d.id = @id)
  AND (@queue_name::text IS NULL OR d.queue_name = @queue_name)
RETURNING d.id
