-- Moves dead letters back for another round of attempts (attempt 0, no
-- claim, deliverable now): 'queue' ones into queue_messages, whose insert
-- trigger wakes the dispatchers, and 'invoke' ones into the outbox. Selected
-- by id, or by app and queue, or every one of an app. The delete and the
-- inserts are one statement, so nothing is lost or doubled.
--
-- Two kinds of selected dead letter cannot move and stay where they are,
-- counted in the result so that the caller can say why: an invoke delivery
-- whose consumer was removed (its outbox row would have no trigger), and
-- one whose id is in use again by a live message or delivery (a producer
-- may choose ids, and may reuse a dead message's). Moving either would
-- fail the whole statement and move nothing else.
WITH sel AS (
    SELECT d.id, d.app_id, d.source,
           d.source = 'invoke' AND NOT EXISTS (SELECT 1 FROM triggers t WHERE t.id = d.trigger_id) AS consumer_gone,
           CASE WHEN d.source = 'queue'
                THEN EXISTS (SELECT 1 FROM queue_messages m WHERE m.id = d.id)
                ELSE EXISTS (SELECT 1 FROM outbox o WHERE o.id = d.id) END AS id_live
    FROM dead_letters d
    JOIN apps a ON a.id = d.app_id
    WHERE a.name = @app_name
      AND (@id::uuid IS NULL OR d.id = @id)
      AND (@queue_name::text IS NULL OR d.queue_name = @queue_name)
), moved AS (
    DELETE FROM dead_letters d
    USING sel
    WHERE d.id = sel.id AND d.app_id = sel.app_id AND d.source = sel.source
      AND NOT sel.consumer_gone AND NOT sel.id_live
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
SELECT (SELECT count(*) FROM q) + (SELECT count(*) FROM o) AS moved,
       (SELECT count(*) FROM sel WHERE consumer_gone) AS consumer_gone,
       (SELECT count(*) FROM sel WHERE id_live AND NOT consumer_gone) AS id_live
