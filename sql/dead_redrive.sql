-- Moves dead letters back for another round of attempts (attempt 0, no
-- claim, deliverable now): 'queue' ones into queue_messages, whose insert
-- trigger wakes the dispatchers, and 'invoke' ones into the outbox while
-- their consumer still exists. Selected by id, or by app and queue; the
-- delete and the inserts are one statement, so nothing is lost or doubled.
WITH moved AS (
    DELETE FROM dead_letters d
    USING apps a
    WHERE a.id = d.app_id AND a.name = @app_name
      AND (@id::uuid IS NULL OR d.id = @id)
      AND (@queue_name::text IS NULL OR d.queue_name = @queue_name)
      AND (d.source = 'queue' OR EXISTS (SELECT 1 FROM triggers t WHERE t.id = d.trigger_id))
    RETURNING d.*
), q AS (
    INSERT INTO queue_messages (id, app_id, queue_name, payload, enqueued_at, max_attempts, enqueued_by_principal)
    SELECT id, app_id, queue_name, payload, enqueued_at, max_attempts, enqueued_by_principal
    FROM moved WHERE source = 'queue'
    RETURNING id
), o AS (
    INSERT INTO outbox (id, app_id, source_kind, trigger_id, payload, enqueued_at, max_attempts)
    SELECT id, app_id, 'invoke', trigger_id, payload, enqueued_at, max_attempts
    FROM moved WHERE source = 'invoke'
    RETURNING id
)
SELECT id FROM q UNION ALL SELECT id FROM o
