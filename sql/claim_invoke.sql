-- Claims up to max_messages ready invoke_async deliveries addressed to one
-- consumer, those that became ready first, as claim_queue.sql does for a
-- queue: two index walks, each locking its candidates with FOR UPDATE
-- SKIP LOCKED and reading only what it may take (0064), the immediate
-- deliveries from idx_outbox_ready (trigger_id, enqueued_at) and the due
-- delayed ones from idx_outbox_delayed (trigger_id, deliver_after); a
-- row's claim_token IS NULL is re-checked once locked. The locked rows are
-- found as id = ANY(ARRAY(...)) for the reason claim_queue.sql gives: a
-- generic plan that probes the primary key.
UPDATE outbox AS m
SET claim_token = gen_random_uuid(),
    claimed_at  = now(),
    attempt     = m.attempt + 1
WHERE m.id = ANY (ARRAY(
    SELECT r.id
    FROM (
        SELECT * FROM (
            SELECT c.id, c.enqueued_at AS ready_at
            FROM outbox AS c
            WHERE c.trigger_id = @trigger_id
              AND c.source_kind = 'invoke'
              AND c.claim_token IS NULL
              AND c.deliver_after IS NULL
            ORDER BY c.enqueued_at
            LIMIT @max_messages
            FOR UPDATE SKIP LOCKED
        ) AS immediate
        UNION ALL
        SELECT * FROM (
            SELECT c.id, greatest(c.deliver_after, c.enqueued_at) AS ready_at
            FROM outbox AS c
            WHERE c.trigger_id = @trigger_id
              AND c.source_kind = 'invoke'
              AND c.claim_token IS NULL
              AND c.deliver_after <= now()
            ORDER BY c.deliver_after
            LIMIT @max_messages
            FOR UPDATE SKIP LOCKED
        ) AS due
    ) AS r
    ORDER BY r.ready_at
    LIMIT @max_messages
))
RETURNING m.id, m.payload, m.enqueued_at, m.claim_token, m.attempt, m.max_attempts, NULL::uuid
