-- Finds the messages that producers leased under the dispatcher's offer
-- tokens (migrations/0044_lease_at_insert.sql) and that it has not heard
-- of: their notifications were sent while its listener was away, or are
-- still on their way. Each token leases at most one message. Read-only;
-- the claim token fences whatever the dispatcher then does with them.
-- vt_secs is the visibility timeout, now, of the consumer that made the
-- token's offer (@consumers, parallel to @tokens), to measure the lease
-- with: if it was lowered since the lease began, the shorter one is safe;
-- if it is lowered later, the reclaim keeps this one as the queue's floor
-- for as long (migration 0047). It is NULL, and the message goes back to
-- the queue, when that consumer no longer serves the message's queue (it
-- was removed, or moved to another queue, and our copy is not yet
-- reloaded), as for a claim (next_due_queue.sql) and as
-- bellhop_lease_message finds the offer's consumer by its id.
SELECT m.id, m.payload, m.enqueued_at, m.claim_token, m.attempt, m.max_attempts,
       m.enqueued_by_principal, m.claimed_at,
       (SELECT d.visibility_timeout_secs
        FROM queue_trigger_details AS d
        JOIN triggers AS t ON t.id = d.trigger_id
        WHERE d.trigger_id = o.consumer_id
          AND d.queue_name = m.queue_name
          AND t.app_id = m.app_id
          AND t.kind = 'queue') AS vt_secs
FROM queue_messages AS m
JOIN unnest(@tokens::uuid[], @consumers::uuid[]) AS o(token, consumer_id) ON o.token = m.claim_token
WHERE m.claim_token = ANY(@tokens::uuid[])
