-- The earliest future deliver_after of a queue's unclaimed messages, so a
-- dispatcher can sleep on a timer until exactly then. One probe of
-- idx_queue_messages_delayed. Read-only; a stale answer only makes the
-- dispatcher wake early (and look again) or be woken by a notification.
SELECT min(deliver_after)
FROM queue_messages
WHERE app_id = @app_id
  AND queue_name = @queue_name
  AND claim_token IS NULL
  AND deliver_after > now()
