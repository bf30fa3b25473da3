-- Deletes this dispatcher's busy mark on a queue, and any mark on it whose
-- lease ended over a minute ago (left by a dispatcher that died). The row
-- is the mark other dispatchers watch; producers read only the busy key
-- (migration 0042), so it is busy_release.sql, run before this, that has
-- them notify again. busy_lock.sql, sent after this in the same batch
-- (claim.Unmark), then checks that the producers that saw the key held
-- have all committed.
DELETE FROM queue_busy
WHERE app_id = @app_id AND queue_name = @queue_name
  AND (owner = @owner OR lease_until < clock_timestamp() - interval '1 minute')
