-- Claims up to max_messages ready messages of one queue, oldest
-- enqueued_at first, and leases them: a fresh claim_token per message,
-- claimed_at = now(), attempt + 1. claim_queues.sql does the same for
-- several queues in one statement; this one, for one queue, costs the
-- server less, and a queue claimed for on its own is the common case.
-- Both return the same columns.
--
-- Safe under concurrency: the inner SELECT locks each candidate with
-- FOR UPDATE SKIP LOCKED, so concurrent dispatchers never wait on, nor
-- take, each other's rows. A row that another transaction claimed and
-- committed after our snapshot is re-checked against claim_token IS NULL
-- once locked (EvalPlanQual) and dropped. The scan uses the partial index
-- idx_queue_messages_dispatch (app_id, queue_name, enqueued_at) WHERE
-- claim_token IS NULL; deliver_after is a filter on it.
--
-- The outer UPDATE finds the locked rows as id = ANY(ARRAY(...)), not as
-- id IN (...): a claim pass runs this statement with its generic plan
-- (generic_plans.sql), which costs LIMIT @max_messages as a tenth of the
-- queue. As a semi-join that plan hashed the whole table when one queue
-- held most of it (4 times slower); the array is probed through the
-- primary key whatever the estimate (TestClaimPlan).
UPDATE queue_messages AS m
SET claim_token = gen_random_uuid(),
    claimed_at  = now(),
    attempt     = m.attempt + 1
WHERE m.id = ANY (ARRAY(
    SELECT c.id
    FROM queue_messages AS c
    WHERE c.app_id = @app_id
      AND c.queue_name = @queue_name
      AND c.claim_token IS NULL
      AND (c.deliver_after IS NULL OR c.deliver_after <= now())
    ORDER BY c.enqueued_at
    LIMIT @max_messages
    FOR UPDATE SKIP LOCKED
))
RETURNING m.app_id, m.queue_name, m.id, m.payload, m.enqueued_at, m.claim_token, m.attempt, m.max_attempts, m.enqueued_by_principal
