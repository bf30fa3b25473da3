-- Deletes one of an app's queue messages that waits for delivery: ready,
-- delayed or waiting for a retry (claim_token NULL). A leased message is
-- left to its delivery: deleting it under a running handler would turn
-- that handler's ack into a lost lease and its nack into nothing, and
-- the message in flight may already have done its work.
--
-- A claim that locked the row first makes this wait for its commit, and
-- the row, read again then, is leased: nothing is deleted. The caller
-- tells why nothing was with message_find.sql.
WITH d AS (
    DELETE FROM queue_messages
    WHERE id = @id AND app_id = @app_id AND claim_token IS NULL
    RETURNING 1
)
SELECT count(*) FROM d
