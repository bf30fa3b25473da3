-- Renews one message's lease for another full visibility timeout from
-- now, if the caller still holds it (claim_token matches) and its queue
-- still has a consumer, and returns whether it is held and the consumer's
-- timeout as this statement reads it, which the renewed lease is measured
-- with (migration 0047; NULL: not renewed). The reclaim statement locks
-- the same row and re-checks claimed_at, so a renewal and a reclaim never
-- both win. min(): should a queue ever have two consumers, the shorter
-- timeout is the one the reclaim uses. The consumer is found by the
-- queue's name, then its app by primary key (triggers has no index on
-- app_id alone).
WITH q AS (
    UPDATE queue_messages AS m SET claimed_at = now()
    FROM (SELECT min(d.visibility_timeout_secs) AS vt_secs
          FROM queue_messages AS k
          JOIN queue_trigger_details AS d ON d.queue_name = k.queue_name
          WHERE k.id = @id
            AND (SELECT t.app_id FROM triggers AS t WHERE t.id = d.trigger_id AND t.kind = 'queue') = k.app_id) AS c
    WHERE m.id = @id AND m.claim_token = @token AND c.vt_secs IS NOT NULL
    RETURNING c.vt_secs
), o AS (
    UPDATE outbox AS m SET claimed_at = now()
    FROM queue_trigger_details AS d
    WHERE m.id = @id AND m.claim_token = @token AND d.trigger_id = m.trigger_id
    RETURNING d.visibility_timeout_secs AS vt_secs
)
SELECT EXISTS (SELECT 1 FROM queue_messages WHERE id = @id AND claim_token = @token)
       OR EXISTS (SELECT 1 FROM outbox WHERE id = @id AND claim_token = @token),
       (SELECT vt_secs FROM q UNION ALL SELECT vt_secs FROM o LIMIT 1)
