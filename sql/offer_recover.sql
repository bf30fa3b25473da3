-- Finds the messages that producers leased under the dispatcher's offer
-- tokens (migrations/0044_lease_at_insert.sql) and that it has not heard
-- of: their notifications were sent while its listener was away, or are
-- still on their way. Each token leases at most one message. Read-only;
-- the claim token fences whatever the dispatcher then does with them.
SELECT m.id, m.payload, m.enqueued_at, m.claim_token, m.attempt, m.max_attempts,
       m.enqueued_by_principal, m.claimed_at
FROM queue_messages AS m
WHERE m.claim_token = ANY(@tokens::uuid[])
