-- Moves a batch of claimed messages to dead_letters: out of attempts, or
-- rejected for good by the consumer. Delete and insert happen in one
-- statement, so a message is never in both tables nor in neither. Fenced
-- by the token like ack.sql: a stale dead-letter moves nothing.
-- o_queue_names names each outbox delivery's consumer queue. A hold
-- (q_holds_ms, o_holds_ms; 0 for none) is kept as redrive_after, the
-- lease's end for work that may still run (migration 0059): a redrive
-- does not make the message claimable before it.
WITH q AS (
    DELETE FROM queue_messages AS m
    USING unnest(@q_ids::uuid[], @q_tokens::uuid[], @q_errors::text[], @q_holds_ms::bigint[]) AS a(id, token, err, hold_ms)
    WHERE m.id = a.id AND m.claim_token = a.token
    RETURNING m.id, 'queue'::text AS source, m.app_id, m.queue_name, NULL::uuid AS trigger_id, m.payload,
              m.enqueued_at, m.deliver_after, m.attempt, m.max_attempts, m.enqueued_by_principal, a.err,
              CASE WHEN a.hold_ms > 0 THEN m.claimed_at + a.hold_ms * interval '1 millisecond' END AS redrive_after,
              a.token
), o AS (
    DELETE FROM outbox AS m
    USING unnest(@o_ids::uuid[], @o_tokens::uuid[], @o_errors::text[], @o_queue_names::text[], @o_holds_ms::bigint[])
          AS a(id, token, err, queue_name, hold_ms)
    WHERE m.id = a.id AND m.claim_token = a.token
    RETURNING m.id, 'invoke'::text AS source, m.app_id, a.queue_name, m.trigger_id, m.payload,
              m.enqueued_at, m.deliver_after, m.attempt, m.max_attempts, NULL::uuid AS enqueued_by_principal, a.err,
              CASE WHEN a.hold_ms > 0 THEN m.claimed_at + a.hold_ms * interval '1 millisecond' END AS redrive_after,
              a.token
), moved AS (
    SELECT id, source, app_id, queue_name, trigger_id, payload, enqueued_at, deliver_after,
           attempt, max_attempts, enqueued_by_principal, err, redrive_after FROM q
    UNION ALL
    SELECT id, source, app_id, queue_name, trigger_id, payload, enqueued_at, deliver_after,
           attempt, max_attempts, enqueued_by_principal, err, redrive_after FROM o
), ins AS (
    INSERT INTO dead_letters (id, source, app_id, queue_name, trigger_id, payload, enqueued_at,
                              deliver_after, attempt, max_attempts, enqueued_by_principal, last_error, redrive_after)
    SELECT * FROM moved
    -- A dead letter is keyed by its message's id within its app and source
    -- (migration 0053), so a queue message and an invoke delivery sharing an
    -- id each keep theirs, and no app's message touches another's. A
    -- producer may choose ids, and one that reuses the id of a message of its
    -- app that is still a dead letter gets, if that message dies too, its
    -- dead letter in place of the old one: the move must not fail (the
    -- message would be retried forever), and the table holds one row per
    -- key. (A redrive cannot cause this: it deletes the dead letter, and
    -- leaves one whose id is live again where it is.)
    ON CONFLICT (id, app_id, source) DO UPDATE SET
        queue_name = EXCLUDED.queue_name,
        trigger_id = EXCLUDED.trigger_id, payload = EXCLUDED.payload, enqueued_at = EXCLUDED.enqueued_at,
        deliver_after = EXCLUDED.deliver_after, attempt = EXCLUDED.attempt, max_attempts = EXCLUDED.max_attempts,
        enqueued_by_principal = EXCLUDED.enqueued_by_principal, last_error = EXCLUDED.last_error,
        died_at = EXCLUDED.died_at, redrive_after = EXCLUDED.redrive_after
    RETURNING id
)
-- Each applied outcome as its id and token (ack.sql says why). The
-- insert runs whether or not its rows are read.
SELECT id, token FROM q UNION ALL SELECT id, token FROM o
