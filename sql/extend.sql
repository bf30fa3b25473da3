-- Renews one message's lease for another full visibility timeout from
-- now, if the caller still holds it (claim_token matches), and returns the
-- consumer's timeout as this statement reads it (NULL: no consumer), to
-- measure the renewed lease with (see next_due_queue.sql). The reclaim
-- statement locks the same row and re-checks claimed_at, so a renewal and
-- a reclaim never both win.
WITH q AS (
    UPDATE queue_messages SET claimed_at = now()
    WHERE id = @id AND claim_token = @token
    RETURNING app_id, queue_name
), o AS (
    UPDATE outbox SET claimed_at = now()
    WHERE id = @id AND claim_token = @token
    RETURNING trigger_id
)
SELECT (SELECT count(*) FROM q) + (SELECT count(*) FROM o),
       coalesce((SELECT min(c.visibility_timeout_secs) FROM q JOIN queue_consumers c USING (app_id, queue_name)),
                (SELECT min(c.visibility_timeout_secs) FROM o JOIN queue_consumers c ON c.id = o.trigger_id))
