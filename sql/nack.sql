-- Nacks a batch: releases each message whose claim_token still matches,
-- so it can be claimed again once deliver_after = now() + its delay has
-- passed. Fenced by the token exactly as ack.sql; a stale nack changes
-- nothing. The attempt already counted at claim time stays counted.
-- A message whose handler was abandoned (its lease ran short, or it gave
-- up on work that may still run: ErrAbandoned) has hold_ms, its visibility
-- timeout (0 otherwise), and stays invisible until its lease would have
-- ended, claimed_at + hold_ms, as a reclaim would keep it: an HTTP
-- consumer may still be working on the request we no longer wait for.
-- It sends no notification: the dispatcher that nacked runs a claim pass
-- once this commits, which reads the new deliver_after as its queue's
-- next due time and arms its timer (lane.go). If that dispatcher has no
-- free slot for the retry then, or when the timer fires, it wakes the
-- others (hand_over.sql, lane.handOff); a notification here would wake a
-- claim pass on every dispatcher for every nack.
WITH q AS (
    UPDATE queue_messages AS m
    SET claim_token = NULL, claimed_at = NULL,
        deliver_after = greatest(now() + a.delay_ms * interval '1 millisecond',
                                 m.claimed_at + a.hold_ms * interval '1 millisecond')
    FROM unnest(@q_ids::uuid[], @q_tokens::uuid[], @q_delays_ms::bigint[], @q_holds_ms::bigint[])
         AS a(id, token, delay_ms, hold_ms)
    WHERE m.id = a.id AND m.claim_token = a.token
    RETURNING m.id, a.token
), o AS (
    UPDATE outbox AS m
    SET claim_token = NULL, claimed_at = NULL,
        deliver_after = greatest(now() + a.delay_ms * interval '1 millisecond',
                                 m.claimed_at + a.hold_ms * interval '1 millisecond')
    FROM unnest(@o_ids::uuid[], @o_tokens::uuid[], @o_delays_ms::bigint[], @o_holds_ms::bigint[])
         AS a(id, token, delay_ms, hold_ms)
    WHERE m.id = a.id AND m.claim_token = a.token
    RETURNING m.id, a.token
)
SELECT id, token FROM q UNION ALL SELECT id, token FROM o
