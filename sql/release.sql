-- Releases a batch of claims whose handlers were interrupted by a clean
-- stop, or whose delivery never started because the claim came back after
-- its lease had run out (a stalled database; lane.go): the message gets
-- back the attempt the claim counted (the interruption was not its fault)
-- and becomes claimable at once, or, if its handler gave up on work that
-- may still run (ErrAbandoned: an HTTP push the stop cut short), when its
-- lease would have ended, claimed_at + hold_ms (0 otherwise), as nack.sql
-- holds it: the consumer may still be working on the request. Fenced by
-- the token like ack.sql. Like reclaim.sql, it wakes the released
-- messages' queues (and consumers' invoke deliveries) with a notification,
-- sent at commit: the dispatchers still running take a ready message over
-- at once rather than at their next fallback poll, and for a held one
-- their claim pass reads its deliver_after as the next due time and arms
-- a timer for it (the stopping dispatcher cannot).
WITH q AS (
    UPDATE queue_messages AS m
    SET claim_token = NULL, claimed_at = NULL, attempt = greatest(m.attempt - 1, 0),
        deliver_after = CASE WHEN a.hold_ms > 0
                             THEN greatest(m.deliver_after, m.claimed_at + a.hold_ms * interval '1 millisecond')
                             ELSE m.deliver_after END
    FROM unnest(@q_ids::uuid[], @q_tokens::uuid[], @q_holds_ms::bigint[]) AS a(id, token, hold_ms)
    WHERE m.id = a.id AND m.claim_token = a.token
    RETURNING m.id, a.token, m.app_id, m.queue_name
), o AS (
    UPDATE outbox AS m
    SET claim_token = NULL, claimed_at = NULL, attempt = greatest(m.attempt - 1, 0),
        deliver_after = CASE WHEN a.hold_ms > 0
                             THEN greatest(m.deliver_after, m.claimed_at + a.hold_ms * interval '1 millisecond')
                             ELSE m.deliver_after END
    FROM unnest(@o_ids::uuid[], @o_tokens::uuid[], @o_holds_ms::bigint[]) AS a(id, token, hold_ms)
    WHERE m.id = a.id AND m.claim_token = a.token
    RETURNING m.id, a.token, m.app_id, m.trigger_id
), wake AS (
    SELECT count(pg_notify('bellhop', w.payload)) AS woken
    FROM (SELECT 'q:' || app_id::text || ':' || queue_name AS payload FROM q
          UNION
          SELECT 'o:' || app_id::text || ':' || trigger_id::text FROM o) AS w
)
-- Joining wake (always one row) makes the notifications part of the result.
SELECT r.id, r.token FROM (SELECT id, token FROM q UNION ALL SELECT id, token FROM o) AS r CROSS JOIN wake
