-- Deletes every busy mark of one dispatcher, as it stops, so producers
-- notify again at once instead of when the leases end.
DELETE FROM queue_busy WHERE owner = @owner
