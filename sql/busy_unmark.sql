-- Deletes this dispatcher's busy mark on a queue, and any mark on it whose
-- lease ended over a minute ago (left by a dispatcher that died). After
-- it commits, new producers notify again; busy_lock.sql then waits out
-- the producers that read the mark before.
DELETE FROM queue_busy
WHERE app_id = @app_id AND queue_name = @queue_name
  AND (owner = @owner OR lease_until < clock_timestamp() - interval '1 minute')
