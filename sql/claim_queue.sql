-- Claims up to max_messages ready messages of one queue, those that
-- became ready first, and leases them: a fresh claim_token per message,
-- claimed_at = now(), attempt + 1. A message became ready at its
-- enqueued_at, or, if it has a deliver_after (a delayed message, or a
-- retry), once that came due: at the later of the two, since a producer
-- may write a deliver_after already past (a catch-up scheduler), and such
-- a message must not go ahead of those enqueued before it. claim_queues.sql does the same for several
-- queues in one statement; this one, for one queue, costs the server
-- less, and a queue claimed for on its own is the common case. Both
-- return the same columns.
--
-- The candidates come from two index walks, each ordered by when its
-- messages became ready, so each reads only what it may take (0064): the
-- immediate messages from idx_queue_messages_ready (app_id, queue_name,
-- enqueued_at) WHERE claim_token IS NULL AND deliver_after IS NULL, and
-- the due delayed ones from idx_queue_messages_delayed (app_id,
-- queue_name, deliver_after), a range up to now(). Walking the seed's
-- dispatch index instead read every not yet due message ahead of the
-- ready ones. Each walk takes up to max_messages; of those, the
-- max_messages that became ready first are claimed. The others, at most
-- max_messages, stay locked only until this statement commits. The due
-- walk's order, by deliver_after, is not quite its ready order where a
-- deliver_after is before its enqueued_at: such a message is placed by
-- its enqueued_at, and until it is claimed it takes one of its walk's
-- places, so a retry due after its deliver_after may wait a claim longer.
--
-- Safe under concurrency: each walk locks its candidates with FOR UPDATE
-- SKIP LOCKED, so concurrent dispatchers never wait on, nor take, each
-- other's rows. A row that another transaction claimed and committed
-- after our snapshot is re-checked against claim_token IS NULL once
-- locked (EvalPlanQual) and dropped; one whose deliver_after a nack set
-- meanwhile is re-checked against its walk's condition too.
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
    SELECT r.id
    FROM (
        SELECT * FROM (
            SELECT c.id, c.enqueued_at AS ready_at
            FROM queue_messages AS c
            WHERE c.app_id = @app_id
              AND c.queue_name = @queue_name
              AND c.claim_token IS NULL
              AND c.deliver_after IS NULL
            ORDER BY c.enqueued_at
            LIMIT @max_messages
            FOR UPDATE SKIP LOCKED
        ) AS immediate
        UNION ALL
        SELECT * FROM (
            SELECT c.id, greatest(c.deliver_after, c.enqueued_at) AS ready_at
            FROM queue_messages AS c
            WHERE c.app_id = @app_id
              AND c.queue_name = @queue_name
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
RETURNING m.app_id, m.queue_name, m.id, m.payload, m.enqueued_at, m.claim_token, m.attempt, m.max_attempts, m.enqueued_by_principal
