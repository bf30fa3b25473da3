-- Releases a batch of claims whose handlers were interrupted by a clean
-- stop, or whose delivery never started because the claim came back after
-- its lease had run out (a stalled database; lane.go): the message becomes
-- claimable at once and gets back the attempt the claim counted. Fenced
-- by the token like ack.sql. Like reclaim.sql, it wakes the released
-- messages' queues (and consumers' invoke deliveries) with a notification,
-- sent at commit, so that the dispatchers still running take them over at
-- once rather than at their next fallback poll. Released messages are
-- ready now, so a wake-up is never wasted on a message that is not yet due.
WITH q AS (
    UPDATE queue_messages AS m
    SET claim_token = NULL, claimed_at = NULL, attempt = greatest(m.attempt - 1, 0)
    FROM unnest(@q_ids::uuid[], @q_tokens::uuid[]) AS a(id, token)
    WHERE m.id = a.id AND m.claim_token = a.token
    RETURNING m.id, m.app_id, m.queue_name
), o AS (
    UPDATE outbox AS m
    SET claim_token = NULL, claimed_at = NULL, attempt = greatest(m.attempt - 1, 0)
    FROM unnest(@o_ids::uuid[], @o_tokens::uuid[]) AS a(id, token)
    WHERE m.id = a.id AND m.claim_token = a.token
    RETURNING m.id, m.app_id, m.trigger_id
), wake AS (
    SELECT count(pg_notify('bellhop', w.payload)) AS woken
    FROM (SELECT 'q:' || app_id::text || ':' || queue_name AS payload FROM q
          UNION
          SELECT 'o:' || app_id::text || ':' || trigger_id::text FROM o) AS w
)
-- Joining wake (always one row) makes the notifications part of the result.
SELECT r.id FROM (SELECT id FROM q UNION ALL SELECT id FROM o) AS r CROSS JOIN wake
