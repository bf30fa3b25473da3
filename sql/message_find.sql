-- Finds an app's queue message by id, after message_delete.sql deleted
-- nothing: whether it is leased (claimed_at: when its lease was taken or
-- last renewed) or
-- gone (no row: never enqueued to this app, or acked, dead-lettered or
-- deleted since). A message waiting for delivery again by now (its
-- delivery failed and was recorded meanwhile) shows with claimed_at NULL.
-- Only claimed_at: message_get.sql would bring a payload of up to 1 MiB
-- to read it.
SELECT claimed_at FROM queue_messages WHERE id = @id AND app_id = @app_id
