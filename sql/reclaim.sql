-- Returns expired leases: every claimed message whose claimed_at is older
-- than its consumer's visibility timeout (default_vt_secs when the queue
-- has no consumer) is released, or moved to dead_letters when it has used
-- all its attempts, and its queue is woken with a notification so that
-- every dispatcher, not only this one, looks again. A timeout lowered
-- lately, or that of a consumer removed lately, still counts at its old
-- length (bellhop_reclaim_vt, migration 0047): leases taken under it last
-- that long. Of the outbox it takes only invoke deliveries: its 'event'
-- and 'cron' rows are the base system's, leased by its own dispatcher
-- (migration 0049).
--
-- A pass takes at most @batch expired leases of each table, so that its
-- time has a bound (the reclaimer cancels a pass that has not answered
-- within its timeout); more says that a table may hold more, and the
-- reclaimer runs the next pass at once.
--
-- logged lists, as a JSON array, at most @dead_logged of the messages it
-- dead-lettered (id, source, app, queue, consumer for an invoke delivery,
-- attempt), for the reclaimer to log them one by one; dead_lettered
-- counts them all. NULL when it dead-lettered none, as nearly every pass:
-- the list costs only the passes that dead-letter, and at most
-- @dead_logged rows' JSON then.
--
-- It reads only leases claimed before now() less bellhop_min_vt (migration
-- 0060), through the claimed_at index: no timeout can have ended a later
-- one, so a pass costs in proportion to the leases older than the
-- shortest timeout, not to every lease in flight. The bound is there
-- twice. Written out, it costs a call of bellhop_min_vt wherever it is
-- tested, so the planner keeps it to an index condition, computed once,
-- and, given the call's values, works out how few leases pass it. From
-- young it is a value computed once, which a scan that tests every row
-- (should many leases be old) tests first, so that bellhop_min_vt runs
-- for the old leases only. With the bound from young alone, a plan made
-- for any values expected a third of the leases to pass and, unless they
-- lay in the table in claim order, scanned the whole table. The rows it
-- takes it finds again by primary key, not by a join that the planner,
-- expecting a full batch, made by hashing the whole table. There is no
-- ORDER BY: with more expired leases than a batch, the server sorted all
-- of them first (TestReclaimReadsOnlyOldLeases).
--
-- It first starts the timeout floors it is the first to see (migration
-- 0054): a floor lasts from when its change is visible, which a statement
-- that sees it began after. The floors it reads below are those of the
-- statement's snapshot, so this pass still counts the ones it starts as
-- pending, in full.
--
-- Safe under concurrency: candidates are locked FOR UPDATE SKIP LOCKED, so
-- two reclaimers never take the same row and a reclaimer never waits on a
-- dispatcher that is acking. After the lock the row is re-checked
-- (EvalPlanQual): one acked, extended or nacked meanwhile no longer
-- matches and is left alone. A handler that is still running after its
-- lease was reclaimed holds a stale token, so its ack changes nothing.
WITH floors AS (
    SELECT bellhop_start_seen_vt_floors() AS started
), young AS (
    SELECT now() - make_interval(secs => bellhop_min_vt(@default_vt_secs)) AS since
), stale_q AS (
    SELECT m.id
    FROM queue_messages m
    LEFT JOIN queue_consumers c ON c.app_id = m.app_id AND c.queue_name = m.queue_name
    WHERE m.claim_token IS NOT NULL
      AND m.claimed_at < (SELECT since FROM young)
      AND m.claimed_at < now() - make_interval(secs => bellhop_min_vt(@default_vt_secs))
      AND m.claimed_at < now() - make_interval(secs => bellhop_reclaim_vt(m.app_id, m.queue_name,
                                                   coalesce(c.visibility_timeout_secs, @default_vt_secs)))
    LIMIT @batch
    FOR UPDATE OF m SKIP LOCKED
), stale_o AS (
    SELECT m.id, c.queue_name
    FROM outbox m
    LEFT JOIN queue_consumers c ON c.id = m.trigger_id
    WHERE m.claim_token IS NOT NULL AND m.source_kind = 'invoke'
      AND m.claimed_at < (SELECT since FROM young)
      AND m.claimed_at < now() - make_interval(secs => bellhop_min_vt(@default_vt_secs))
      AND m.claimed_at < now() - make_interval(secs => bellhop_reclaim_vt(m.app_id, c.queue_name,
                                                   coalesce(c.visibility_timeout_secs, @default_vt_secs)))
    LIMIT @batch
    FOR UPDATE OF m SKIP LOCKED
), released_q AS (
    UPDATE queue_messages m SET claim_token = NULL, claimed_at = NULL
    WHERE m.id = ANY (ARRAY(SELECT id FROM stale_q)) AND m.attempt < m.max_attempts
    RETURNING m.app_id, m.queue_name
), released_o AS (
    UPDATE outbox m SET claim_token = NULL, claimed_at = NULL
    WHERE m.id = ANY (ARRAY(SELECT id FROM stale_o)) AND m.attempt < m.max_attempts
    RETURNING m.app_id, m.trigger_id
), dead_q AS (
    DELETE FROM queue_messages m
    WHERE m.id = ANY (ARRAY(SELECT id FROM stale_q)) AND m.attempt >= m.max_attempts
    RETURNING m.id, 'queue'::text, m.app_id, m.queue_name, NULL::uuid, m.payload, m.enqueued_at,
              m.deliver_after, m.attempt, m.max_attempts, m.enqueued_by_principal
), dead_o AS (
    DELETE FROM outbox m
    USING stale_o s
    WHERE m.id = ANY (ARRAY(SELECT id FROM stale_o)) AND m.id = s.id AND m.attempt >= m.max_attempts
    RETURNING m.id, 'invoke'::text, m.app_id, coalesce(s.queue_name, ''), m.trigger_id, m.payload, m.enqueued_at,
              m.deliver_after, m.attempt, m.max_attempts, NULL::uuid
), dead AS (
    INSERT INTO dead_letters (id, source, app_id, queue_name, trigger_id, payload, enqueued_at,
                              deliver_after, attempt, max_attempts, enqueued_by_principal, last_error)
    SELECT d.*, 'visibility timeout expired on the last attempt' FROM dead_q d
    UNION ALL
    SELECT d.*, 'visibility timeout expired on the last attempt' FROM dead_o d
    ON CONFLICT (id, app_id, source) DO UPDATE SET
        queue_name = EXCLUDED.queue_name,
        trigger_id = EXCLUDED.trigger_id, payload = EXCLUDED.payload, enqueued_at = EXCLUDED.enqueued_at,
        deliver_after = EXCLUDED.deliver_after, attempt = EXCLUDED.attempt, max_attempts = EXCLUDED.max_attempts,
        enqueued_by_principal = EXCLUDED.enqueued_by_principal, last_error = EXCLUDED.last_error,
        died_at = EXCLUDED.died_at, redrive_after = EXCLUDED.redrive_after
    RETURNING id, source, app_id, queue_name, trigger_id, attempt, max_attempts
), wake AS (
    SELECT DISTINCT 'q:' || app_id::text || ':' || queue_name AS payload FROM released_q
    UNION
    SELECT DISTINCT 'o:' || app_id::text || ':' || trigger_id::text FROM released_o
)
SELECT (SELECT count(*) FROM released_q) + (SELECT count(*) FROM released_o) AS released,
       (SELECT count(*) FROM dead) AS dead_lettered,
       (SELECT count(pg_notify('bellhop', payload)) FROM wake) AS woken,
       (SELECT started FROM floors) AS floors_started,
       (SELECT count(*) FROM stale_q) >= @batch OR (SELECT count(*) FROM stale_o) >= @batch AS more,
       (SELECT json_agg(json_build_object('id', id, 'source', source, 'app_id', app_id, 'queue', queue_name,
                                          'consumer_id', trigger_id, 'attempt', attempt, 'max_attempts', max_attempts))
        FROM (SELECT * FROM dead LIMIT @dead_logged) d) AS logged
