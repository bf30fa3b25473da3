-- Claims up to max_messages ready invoke_async deliveries addressed to one
-- consumer. Same concurrency argument as claim_queue.sql: FOR UPDATE SKIP
-- LOCKED in the inner SELECT, re-check of claim_token IS NULL once locked.
-- Uses idx_outbox_dispatch (trigger_id, enqueued_at) WHERE claim_token IS NULL.
-- The locked rows are found as id = ANY(ARRAY(...)) for the reason
-- claim_queue.sql gives: a generic plan that probes the primary key.
UPDATE outbox AS m
SET claim_token = gen_random_uuid(),
    claimed_at  = now(),
    attempt     = m.attempt + 1
WHERE m.id = ANY (ARRAY(
    SELECT c.id
    FROM outbox AS c
    WHERE c.trigger_id = @trigger_id
      AND c.source_kind = 'invoke'
      AND c.claim_token IS NULL
      AND (c.deliver_after IS NULL OR c.deliver_after <= now())
    ORDER BY c.enqueued_at
    LIMIT @max_messages
    FOR UPDATE SKIP LOCKED
))
RETURNING m.id, m.payload, m.enqueued_at, m.claim_token, m.attempt, m.max_attempts, NULL::uuid
