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
--
-- A renewal is committed durably, whatever the session's
-- synchronous_commit (the dispatcher's sessions run with it off): one a
-- server crash lost would put the lease back to its old start while its
-- handler, told it was renewed, runs on, and the reclaim would hand the
-- message to a second handler. set_config(..., true) sets it for this
-- statement's own transaction, whose commit reads it. 'local' flushes the
-- server's own WAL and does not wait for a synchronous standby: with one
-- down, renewals would hang, and long handlers lose their leases.
-- Renewals are rare, so the flush costs little.
--
-- The lease's start only moves forward (greatest): now() is when the
-- statement began, not when it got the row, so of two renewals of one
-- lease at once, the one that began first may commit last. Setting its
-- older now() would move the start back, while the handler's deadline
-- follows whichever answer it handles last, possibly the newer one's:
-- the reclaim would then take the message while its handler is still
-- told it holds the lease.
--
-- "Held" comes from the row lock, not from the statement's snapshot: a
-- reclaim or a settle that commits while this statement waits for the row
-- is seen by the lock's re-check (EvalPlanQual) and not by the snapshot,
-- which would report a lease that is gone as held (and, no longer
-- matching for the UPDATE, as not renewed: "no consumer").
WITH durable AS (
    SELECT set_config('synchronous_commit', 'local', true)
), lq AS (
    SELECT m.id, m.app_id, m.queue_name FROM queue_messages AS m
    WHERE m.id = @id AND m.claim_token = @token
    FOR NO KEY UPDATE
), q AS (
    UPDATE queue_messages AS m SET claimed_at = greatest(m.claimed_at, now())
    FROM lq, (SELECT min(d.visibility_timeout_secs) AS vt_secs
              FROM lq AS k
              JOIN queue_trigger_details AS d ON d.queue_name = k.queue_name
              WHERE (SELECT t.app_id FROM triggers AS t WHERE t.id = d.trigger_id AND t.kind = 'queue') = k.app_id) AS c
    WHERE m.id = lq.id AND c.vt_secs IS NOT NULL
    RETURNING c.vt_secs
), lo AS (
    SELECT m.id, m.trigger_id FROM outbox AS m
    WHERE m.id = @id AND m.claim_token = @token
    FOR NO KEY UPDATE
), o AS (
    UPDATE outbox AS m SET claimed_at = greatest(m.claimed_at, now())
    FROM lo JOIN queue_trigger_details AS d ON d.trigger_id = lo.trigger_id
    WHERE m.id = lo.id
    RETURNING d.visibility_timeout_secs AS vt_secs
)
SELECT EXISTS (SELECT 1 FROM lq) OR EXISTS (SELECT 1 FROM lo),
       (SELECT vt_secs FROM q UNION ALL SELECT vt_secs FROM o LIMIT 1)
FROM durable
