-- Claims reach a queue's ready messages without reading its delayed ones.
--
-- The seed's dispatch index, (app_id, queue_name, enqueued_at) WHERE
-- claim_token IS NULL, holds delayed messages too: deliver_after can only
-- be a filter on it, since now() cannot be in an index's predicate. A
-- claim walked the index in enqueued_at order and read, and dropped, every
-- not yet due message enqueued before the ready ones it took: a queue
-- with 200,000 messages scheduled for tomorrow ahead of its ready ones took
-- 21 ms a claim, and 18 ms more for the pass's "ready left" read, against
-- a fraction of a millisecond. Retries are the common case: a nack
-- always sets deliver_after, so during a consumer's outage its whole
-- backlog of retries sat at the head of the walk, and every claim pass
-- (one after each nack) read all of it: server time in the square of the
-- backlog.
--
-- A claim now reads two indexes, each only as far as it takes:
--   * the immediate messages (deliver_after NULL), oldest enqueued_at
--     first, from the index below;
--   * the delayed messages that are due, earliest deliver_after first, from
--     idx_queue_messages_delayed (0038), which is ordered by deliver_after,
--     so a range scan up to now() reads only due ones;
-- and takes the messages that became ready first: a delayed or retried
-- message counts from its deliver_after, or its enqueued_at if that is
-- later (sql/claim_queue.sql).
--
-- The invoke deliveries in the outbox get the same (sql/claim_invoke.sql,
-- with idx_outbox_delayed of 0048).
--
-- Each index costs every INSERT of its table one more index entry
-- (BENCHMARKS.md, "Ready indexes"). Built inside the migration's
-- transaction, as the others are (migrations.go): writes to the table wait
-- while it builds. On a large table, build them beforehand with CREATE
-- INDEX CONCURRENTLY under these names and definitions; IF NOT EXISTS
-- then keeps them (and would keep an invalid one, left by a concurrent
-- build that failed: drop that first).
CREATE INDEX IF NOT EXISTS idx_queue_messages_ready
    ON queue_messages (app_id, queue_name, enqueued_at)
    WHERE claim_token IS NULL AND deliver_after IS NULL;

CREATE INDEX IF NOT EXISTS idx_outbox_ready
    ON outbox (trigger_id, enqueued_at)
    WHERE claim_token IS NULL AND deliver_after IS NULL;
