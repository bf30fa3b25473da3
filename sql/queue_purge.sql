-- Deletes a batch of at most @batch of a queue's messages that wait for
-- delivery (ready, delayed or waiting for a retry: claim_token NULL) and
-- whose enqueued_at (their producer's transaction start, for the Go
-- client, enqueue() and a plain INSERT's default alike) is no later than
-- @before, the purge's start (NULL on its first batch: now, which is
-- returned for the next). Client.PurgeQueue runs it until a batch comes
-- up short, so that each batch's locks and WAL stay bounded, and the
-- bound on enqueued_at ends a purge that producers keep up with.
--
-- The rows are locked in enqueued_at order, as idx_queue_messages_dispatch
-- gives them, waiting for any lock held on one: a claim locks more rows
-- than it leases (sql/claim_queue.sql's two walks), for its one
-- statement, and a purge that skipped those would leave messages it
-- should delete, to be delivered. A row read again after such a wait
-- that was leased meanwhile no longer matches and is left to its
-- delivery; the LIMIT counts only rows locked, so a short batch means
-- none is left. Nothing waits for a purge in turn that a purge waits
-- for: claims skip locked rows, acks, nacks and reclaims lock leased
-- ones, which a purge never locks, and two purges lock in one order.
WITH sel AS (
    SELECT m.id
    FROM queue_messages m
    WHERE m.app_id = @app_id AND m.queue_name = @queue_name
      AND m.claim_token IS NULL
      AND m.enqueued_at <= coalesce(@before::timestamptz, now())
    ORDER BY m.enqueued_at
    LIMIT @batch
    FOR UPDATE
), deleted AS (
    DELETE FROM queue_messages m
    WHERE m.id = ANY (ARRAY(SELECT id FROM sel))
      AND m.app_id = @app_id AND m.claim_token IS NULL
    RETURNING 1
)
SELECT (SELECT count(*) FROM deleted) AS deleted, coalesce(@before::timestamptz, now()) AS before
