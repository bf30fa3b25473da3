-- Dead letters of one app (or of all), optionally of one queue or with one
-- id, newest first, optionally after a given one. The app is looked up first, so that its dead letters
-- are read newest first from idx_dead_letters_died (migration 0059) and
-- the scan stops at @max_rows; filtered through the join, every dead
-- letter of the table was read and sorted. dead_list_brief.sql is the
-- same without the payloads: keep the two alike.
SELECT d.id, d.source, a.name, d.queue_name, d.trigger_id, d.payload, d.enqueued_at,
       d.deliver_after, d.attempt, d.max_attempts, d.enqueued_by_principal, d.last_error, d.died_at, d.redrive_after
FROM dead_letters d JOIN apps a ON a.id = d.app_id
WHERE (@app_name::text IS NULL OR d.app_id = (SELECT id FROM apps WHERE name = @app_name))
  AND (@queue_name::text IS NULL OR d.queue_name = @queue_name)
  AND (@id::uuid IS NULL OR d.id = @id)
  -- After the row (@after_died, @after_id, @after_source) in this order,
  -- which is total: a message and an invoke delivery may share an id. The
  -- first test alone bounds the index scan; the second drops the ties
  -- before the row.
  AND (@after_id::uuid IS NULL
       OR (d.died_at <= @after_died
           AND (d.died_at < @after_died OR (d.id, d.source) > (@after_id, @after_source::text))))
ORDER BY d.died_at DESC, d.id, d.source
LIMIT @max_rows
