-- One of an app's queue messages, by id, as it stands: waiting for
-- delivery (claimed_at NULL) or being delivered under a lease taken or
-- last renewed at claimed_at. No row: never enqueued to this app, or
-- acked, dead-lettered or deleted since. Client.QueuedMessage shows it.
SELECT m.id, a.name, m.queue_name, m.payload, m.enqueued_at, m.deliver_after,
       m.attempt, m.max_attempts, m.enqueued_by_principal, m.claimed_at
FROM queue_messages m JOIN apps a ON a.id = m.app_id
WHERE m.id = @id AND m.app_id = @app_id
