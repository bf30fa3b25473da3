-- Finds an app's queue message by id, after message_delete.sql deleted
-- nothing: whether it is leased (claimed_at, when its delivery began) or
-- gone (no row: never enqueued to this app, or acked, dead-lettered or
-- deleted since). A message waiting for delivery again by now (its
-- delivery failed and was recorded meanwhile) shows with claimed_at NULL.
SELECT claimed_at FROM queue_messages WHERE id = @id AND app_id = @app_id
