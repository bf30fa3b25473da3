-- The earliest future deliver_after of a queue's unclaimed messages, so a
-- dispatcher can sleep on a timer until exactly then (one probe of
-- idx_queue_messages_delayed), and the latest live busy-mark lease held on
-- the queue by another dispatcher, so an idle dispatcher can check again
-- when it ends. Read-only; a stale answer only makes the dispatcher wake
-- early and look again.
SELECT (SELECT min(deliver_after)
        FROM queue_messages
        WHERE app_id = @app_id
          AND queue_name = @queue_name
          AND claim_token IS NULL
          AND deliver_after > now()),
       (SELECT max(lease_until)
        FROM queue_busy
        WHERE app_id = @app_id AND queue_name = @queue_name
          AND owner <> @owner AND lease_until > clock_timestamp())
