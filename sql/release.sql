-- Releases a batch of claims whose handlers were interrupted by a clean
-- stop: the message becomes claimable at once and gets back the attempt
-- its interrupted delivery used. Fenced by the token like ack.sql.
WITH q AS (
    UPDATE queue_messages AS m
    SET claim_token = NULL, claimed_at = NULL, attempt = greatest(m.attempt - 1, 0)
    FROM unnest(@q_ids::uuid[], @q_tokens::uuid[]) AS a(id, token)
    WHERE m.id = a.id AND m.claim_token = a.token
    RETURNING m.id
), o AS (
    UPDATE outbox AS m
    SET claim_token = NULL, claimed_at = NULL, attempt = greatest(m.attempt - 1, 0)
    FROM unnest(@o_ids::uuid[], @o_tokens::uuid[]) AS a(id, token)
    WHERE m.id = a.id AND m.claim_token = a.token
    RETURNING m.id
)
SELECT id FROM q UNION ALL SELECT id FROM o
