-- Renews one message's lease for another full visibility timeout from
-- now, if the caller still holds it (claim_token matches). The reclaim
-- statement locks the same row and re-checks claimed_at, so a renewal and
-- a reclaim never both win.
WITH q AS (
    UPDATE queue_messages SET claimed_at = now()
    WHERE id = @id AND claim_token = @token
    RETURNING 1
), o AS (
    UPDATE outbox SET claimed_at = now()
    WHERE id = @id AND claim_token = @token
    RETURNING 1
)
SELECT (SELECT count(*) FROM q) + (SELECT count(*) FROM o)
