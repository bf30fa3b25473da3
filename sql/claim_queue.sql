-- Claims up to max_messages ready messages of one queue, oldest
-- enqueued_at first, and leases them: a fresh claim_token per message,
-- claimed_at = now(), attempt + 1.
--
-- Safe under concurrency: the inner SELECT locks each candidate with
-- FOR UPDATE SKIP LOCKED, so concurrent dispatchers never wait on, nor
-- take, each other's rows. A row that another transaction claimed and
-- committed after our snapshot is re-checked against claim_token IS NULL
-- once locked (EvalPlanQual) and dropped. The scan uses the partial index
-- idx_queue_messages_dispatch (app_id, queue_name, enqueued_at) WHERE
-- claim_token IS NULL; deliver_after is a filter on it.
--
-- It also returns the consumer's visibility timeout as this transaction
-- reads it, which the leases are measured with, and claims nothing if
-- the queue has no consumer: the reclaim honours that timeout even if it
-- is lowered or the consumer removed later (migration 0047), while the
-- dispatcher's copy may be one reload behind. min(): should a queue ever
-- have two consumers, the shorter is the one the reclaim uses.
WITH c AS (
    SELECT min(d.visibility_timeout_secs) AS vt_secs
    FROM queue_trigger_details AS d
    JOIN triggers AS t ON t.id = d.trigger_id
    WHERE d.queue_name = @queue_name AND t.app_id = @app_id AND t.kind = 'queue'
)
UPDATE queue_messages AS m
SET claim_token = gen_random_uuid(),
    claimed_at  = now(),
    attempt     = m.attempt + 1
FROM c
WHERE c.vt_secs IS NOT NULL
  AND m.id IN (
    SELECT c.id
    FROM queue_messages AS c
    WHERE c.app_id = @app_id
      AND c.queue_name = @queue_name
      AND c.claim_token IS NULL
      AND (c.deliver_after IS NULL OR c.deliver_after <= now())
    ORDER BY c.enqueued_at
    LIMIT @max_messages
    FOR UPDATE SKIP LOCKED
)
RETURNING m.id, m.payload, m.enqueued_at, m.claim_token, m.attempt, m.max_attempts, m.enqueued_by_principal,
          c.vt_secs
