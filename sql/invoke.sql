-- Adds one invoke_async delivery for a queue consumer to the outbox. No
-- row: the consumer is unknown, or the acting principal (when not NULL)
-- belongs to another app. A delay (in microseconds) counts on the
-- database's clock, as in enqueue.sql.
-- The consumer's row is locked FOR KEY SHARE, the lock the outbox's
-- foreign key check takes on it anyway (so it costs nothing more): a
-- removal in progress is waited for, and once it commits the row drops out
-- (READ COMMITTED re-checks it after the lock), so the statement returns
-- no row rather than failing that check with SQLSTATE 23503. A removal
-- that starts later waits for this statement's transaction.
INSERT INTO outbox (id, app_id, source_kind, trigger_id, payload, deliver_after, max_attempts)
SELECT @id, t.app_id, 'invoke', t.id, @payload,
       coalesce(@deliver_after::timestamptz, clock_timestamp() + @delay_us::bigint * interval '1 microsecond'),
       coalesce(@max_attempts, t.max_attempts)
FROM triggers t
WHERE t.id = @trigger_id AND t.kind = 'queue'
  AND (@actor::uuid IS NULL
       OR EXISTS (SELECT 1 FROM principals p WHERE p.id = @actor AND p.app_id = t.app_id))
FOR KEY SHARE OF t
RETURNING id
