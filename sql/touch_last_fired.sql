-- Records that consumers were just delivered to. A dispatcher calls it at
-- most about once a second per consumer, so the rows never run hot. The
-- column is informational: a failed update is retried with the next
-- second's, which writes its own now().
UPDATE queue_trigger_details SET last_fired_at = now()
WHERE trigger_id = ANY(@trigger_ids::uuid[])
