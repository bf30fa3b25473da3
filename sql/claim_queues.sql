-- Claims ready messages of several queues, up to max_messages[i] of
-- queue (app_ids[i], queue_names[i]), oldest enqueued_at first, and
-- leases them as claim_queue.sql does for one queue: a fresh claim_token
-- per message, claimed_at = now(), attempt + 1. The queues are distinct.
-- A dispatcher claims for several queues at once when their claim passes
-- would otherwise wait for one another (claim.Combiner): one statement
-- for ten queues takes a third or less of the server's time of ten
-- claim_queue.sql (BENCHMARKS.md, "combined claim passes").
--
-- Safe under concurrency: the inner SELECT locks each candidate with
-- FOR UPDATE SKIP LOCKED, so concurrent dispatchers never wait on, nor
-- take, each other's rows. A row that another transaction claimed and
-- committed after our snapshot is re-checked against claim_token IS NULL
-- once locked (EvalPlanQual) and dropped. Each queue's scan uses the
-- partial index idx_queue_messages_dispatch (app_id, queue_name,
-- enqueued_at) WHERE claim_token IS NULL; deliver_after is a filter on
-- it. Its LIMIT is the queue's own, so one queue's backlog never takes
-- another's share.
--
-- The locked rows are found through an array for the reason
-- claim_queue.sql gives (TestClaimPlan checks both statements' plans).
UPDATE queue_messages AS m
SET claim_token = gen_random_uuid(),
    claimed_at  = now(),
    attempt     = m.attempt + 1
WHERE m.id = ANY (ARRAY(
    SELECT c.id
    FROM unnest(@app_ids::uuid[], @queue_names::text[], @max_messages::int[]) AS q (app_id, queue_name, max_messages)
    CROSS JOIN LATERAL (
        SELECT c.id
        FROM queue_messages AS c
        WHERE c.app_id = q.app_id
          AND c.queue_name = q.queue_name
          AND c.claim_token IS NULL
          AND (c.deliver_after IS NULL OR c.deliver_after <= now())
        ORDER BY c.enqueued_at
        LIMIT q.max_messages
        FOR UPDATE SKIP LOCKED
    ) AS c
))
RETURNING m.app_id, m.queue_name, m.id, m.payload, m.enqueued_at, m.claim_token, m.attempt, m.max_attempts, m.enqueued_by_principal
