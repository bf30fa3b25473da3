-- Finds the messages that producers leased under the dispatcher's offer
-- tokens (migrations/0044_lease_at_insert.sql) and that it has not heard
-- of: their notifications were sent while its listener was away, or are
-- still on their way. Each token leases at most one message. Read-only;
-- the claim token fences whatever the dispatcher then does with them.
-- vt_secs is the consumer's visibility timeout now, to measure the lease
-- with: if it was lowered since the lease began, the shorter one is safe;
-- if it is lowered later, the reclaim keeps this one as the queue's floor
-- for as long (migration 0047). The consumer is found by the queue's
-- name, then its app by primary key, as in bellhop_lease_message.
SELECT m.id, m.payload, m.enqueued_at, m.claim_token, m.attempt, m.max_attempts,
       m.enqueued_by_principal, m.claimed_at,
       (SELECT min(d.visibility_timeout_secs)
        FROM queue_trigger_details AS d
        WHERE d.queue_name = m.queue_name
          AND (SELECT t.app_id FROM triggers AS t WHERE t.id = d.trigger_id AND t.kind = 'queue') = m.app_id) AS vt_secs
FROM queue_messages AS m
WHERE m.claim_token = ANY(@tokens::uuid[])
