-- Acks a batch: deletes each message whose claim_token still equals the
-- token its handler was given. The token is the fence: if the lease
-- expired and the message was reclaimed (token NULL) or claimed again
-- (new token), the stale ack matches nothing and changes nothing. The row
-- lock taken by DELETE serialises it against a concurrent reclaim, which
-- re-checks its own condition after the lock.
-- The q_ arrays are queue_messages rows, the o_ arrays outbox rows. Each
-- applied outcome is returned as its id and token: a batch may carry a
-- stale outcome beside the current one for the same message.
WITH q AS (
    DELETE FROM queue_messages AS m
    USING unnest(@q_ids::uuid[], @q_tokens::uuid[]) AS a(id, token)
    WHERE m.id = a.id AND m.claim_token = a.token
    RETURNING m.id, a.token
), o AS (
    DELETE FROM outbox AS m
    USING unnest(@o_ids::uuid[], @o_tokens::uuid[]) AS a(id, token)
    WHERE m.id = a.id AND m.claim_token = a.token
    RETURNING m.id, a.token
)
SELECT id, token FROM q UNION ALL SELECT id, token FROM o
