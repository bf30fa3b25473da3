-- Claims ready messages of several queues, up to max_messages[i] of
-- queue (app_ids[i], queue_names[i]), those that became ready first, and
-- leases them as claim_queue.sql does for one queue: a fresh claim_token
-- per message, claimed_at = now(), attempt + 1. The queues are distinct.
-- A dispatcher claims for several queues at once when their claim passes
-- would otherwise wait for one another (claim.Combiner): one statement
-- for ten queues takes a third or less of the server's time of ten
-- claim_queue.sql (BENCHMARKS.md, "combined claim passes").
--
-- Each queue's candidates come from the same two index walks as in
-- claim_queue.sql, which says why and how they are locked (FOR UPDATE
-- SKIP LOCKED, so concurrent dispatchers never wait on, nor take, each
-- other's rows). Each queue's LIMIT is its own, so one queue's backlog
-- never takes another's share.
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
        SELECT r.id
        FROM (
            SELECT * FROM (
                SELECT c.id, c.enqueued_at AS ready_at
                FROM queue_messages AS c
                WHERE c.app_id = q.app_id
                  AND c.queue_name = q.queue_name
                  AND c.claim_token IS NULL
                  AND c.deliver_after IS NULL
                ORDER BY c.enqueued_at
                LIMIT q.max_messages
                FOR UPDATE SKIP LOCKED
            ) AS immediate
            UNION ALL
            SELECT * FROM (
                SELECT c.id, greatest(c.deliver_after, c.enqueued_at) AS ready_at
                FROM queue_messages AS c
                WHERE c.app_id = q.app_id
                  AND c.queue_name = q.queue_name
                  AND c.claim_token IS NULL
                  AND c.deliver_after <= now()
                ORDER BY c.deliver_after
                LIMIT q.max_messages
                FOR UPDATE SKIP LOCKED
            ) AS due
        ) AS r
        ORDER BY r.ready_at
        LIMIT q.max_messages
    ) AS c
))
RETURNING m.app_id, m.queue_name, m.id, m.payload, m.enqueued_at, m.claim_token, m.attempt, m.max_attempts, m.enqueued_by_principal
