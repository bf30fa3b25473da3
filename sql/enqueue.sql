-- Inserts a batch of messages for one app in one statement, all or none.
-- Arguments are parallel arrays, one element per message; the ids are made
-- by the client so that it knows them without relying on RETURNING order.
-- Nothing is inserted when the app is unknown or when any principal does
-- not belong to the app; the counts in the result tell the caller which,
-- and first_foreign the position (from 1) of the first such message.
-- Table constraints reject bad queue names, attempts and payload sizes for
-- the whole statement. A message is due at its deliver_after, or after its
-- delay (in microseconds) on the database's clock, not the producer's,
-- which may be off. Each message's enqueued_at is the transaction's
-- start plus, in microseconds, its position in the batch and the number
-- of messages this transaction enqueued before it through these
-- statements (the bellhop.enqueue_seq setting, local to the transaction):
-- the claim takes the oldest first, and messages with one enqueued_at
-- come in whatever order the heap holds them, which reuses free space on
-- earlier pages, so a batch, or the batches of one transaction (the
-- CLI's stream, EnqueueTx called in a loop), could be claimed out of
-- their order. The setting is read once (seq, materialised) before the
-- insert and written after it (counted); a value that is not a count of
-- at most nine digits is read as 0, so that a forged one moves a message
-- at most about 17 minutes later, never earlier.
-- The app's row is locked FOR KEY SHARE, the lock the foreign key's check
-- takes on it anyway, but at COMMIT since migration 0067: taken here, a
-- deletion of the app waits for the producer's transaction, as it did
-- when the key was checked at the statement, instead of committing first
-- and failing the producer's COMMIT; one in progress is waited for, and
-- once it commits the app is not found.
WITH app AS (
    SELECT id FROM apps WHERE name = @app_name FOR KEY SHARE
), seq AS MATERIALIZED (
    SELECT coalesce(substring(current_setting('bellhop.enqueue_seq', true) FROM '^[0-9]{1,9}$')::bigint, 0) AS base
), input AS (
    SELECT *
    FROM unnest(@ids::uuid[], @queue_names::text[], @payloads::jsonb[],
                @deliver_after::timestamptz[], @delays_us::bigint[], @max_attempts::int[], @principals::uuid[])
         WITH ORDINALITY AS m(id, queue_name, payload, deliver_after, delay_us, max_attempts, principal, ord)
), foreign_principals AS (
    SELECT count(*) AS n, min(ord) AS first
    FROM input i
    WHERE i.principal IS NOT NULL
      AND NOT EXISTS (SELECT 1 FROM principals p JOIN app ON p.app_id = app.id WHERE p.id = i.principal)
), inserted AS (
    INSERT INTO queue_messages (id, app_id, queue_name, payload, enqueued_at, deliver_after, max_attempts, enqueued_by_principal)
    -- max_attempts defaults as in bellhop_default_max_attempts(); joined
    -- here rather than called, because a SQL function in this position is
    -- planned again on every call (about half a millisecond).
    SELECT i.id, app.id, i.queue_name, i.payload, now() + ((SELECT base FROM seq) + i.ord - 1) * interval '1 microsecond',
           coalesce(i.deliver_after, clock_timestamp() + i.delay_us * interval '1 microsecond'),
           coalesce(i.max_attempts, c.max_attempts, 3), i.principal
    FROM input i
    CROSS JOIN app
    LEFT JOIN LATERAL (SELECT max_attempts FROM queue_consumers
                       WHERE app_id = app.id AND queue_name = i.queue_name
                       LIMIT 1) c ON true
    WHERE (SELECT n FROM foreign_principals) = 0
    RETURNING 1
), counted AS (
    SELECT c.n, set_config('bellhop.enqueue_seq', (seq.base + c.n)::text, true)
    FROM (SELECT count(*) AS n FROM inserted) AS c, seq
)
SELECT EXISTS (SELECT 1 FROM app) AS app_found,
       (SELECT n FROM foreign_principals) AS foreign_principals,
       (SELECT n FROM counted) AS inserted,
       (SELECT first FROM foreign_principals) AS first_foreign
