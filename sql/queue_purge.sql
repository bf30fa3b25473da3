-- Deletes a batch of at most @batch of a queue's messages that wait for
-- delivery (ready, delayed or waiting for a retry: claim_token NULL) and
-- were enqueued no later than @before, the purge's start (NULL on its
-- first batch: now, which is returned for the next). Client.PurgeQueue
-- runs it until a batch comes up short, so that each batch's locks and
-- WAL stay bounded, and the bound on enqueued_at ends a purge that
-- producers keep up with.
--
-- The rows are locked SKIP LOCKED, as claims lock them, and in
-- enqueued_at order, as the claim index (idx_queue_messages_dispatch)
-- gives them: a row a claim has locked is being leased and is left to
-- its delivery, and nothing here waits for a lock, so a purge deadlocks
-- with nothing. A row changed since the statement began is read again
-- before it is locked: one leased meanwhile no longer matches.
WITH sel AS (
    SELECT m.id
    FROM queue_messages m
    WHERE m.app_id = @app_id AND m.queue_name = @queue_name
      AND m.claim_token IS NULL
      AND m.enqueued_at <= coalesce(@before::timestamptz, now())
    ORDER BY m.enqueued_at
    LIMIT @batch
    FOR UPDATE SKIP LOCKED
), deleted AS (
    DELETE FROM queue_messages m
    WHERE m.id = ANY (ARRAY(SELECT id FROM sel))
      AND m.app_id = @app_id AND m.claim_token IS NULL
    RETURNING 1
)
SELECT (SELECT count(*) FROM deleted) AS deleted, coalesce(@before::timestamptz, now()) AS before
