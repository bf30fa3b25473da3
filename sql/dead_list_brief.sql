-- dead_list.sql without the payloads, for listings that never show them
-- (bellhop dead ls): each payload may be up to 1 MiB and a listing up to
-- 10,000 rows, all held in the client's memory at once. The payload
-- column is not read at all, not even as NULL through a CASE, so the
-- server detoasts none and a role granted SELECT on every column of
-- dead_letters but the payload may list them. Its NULL keeps the columns
-- of dead_list.sql, so that both are scanned alike. Keep the two alike.
SELECT d.id, d.source, a.name, d.queue_name, d.trigger_id, NULL::jsonb, d.enqueued_at,
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
