-- Removes a consumer; queue_trigger_details and its outbox rows go with it
-- (ON DELETE CASCADE). Messages already in the queue stay, for a future
-- consumer of the same queue.
DELETE FROM triggers WHERE id = @id AND kind = 'queue' AND app_id = @app_id
RETURNING id
