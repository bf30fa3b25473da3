-- Moves dead letters back for another round of attempts (attempt 0, no
-- claim, deliverable now, or at its redrive_after if that is later: the
-- end of the last attempt's lease, for work that may still run, migration
-- 0059; enqueued now: behind the queue's backlog, and
-- with its age and latency counted from the redrive, not from a first
-- enqueue that may be days old): 'queue' ones into queue_messages, whose insert
-- trigger wakes the dispatchers, and 'invoke' ones into the outbox. Selected
-- by id, or by app and queue, or every one of an app. A dead letter is
-- deleted only once its message is inserted, in the same statement, so
-- nothing is lost or doubled.
--
-- Two kinds of selected dead letter cannot move and stay where they are,
-- counted in the result so that the caller can say why: an invoke delivery
-- whose consumer was removed (its outbox row would have no trigger), and
-- one whose id is in use again by a live message or delivery (a producer
-- may choose ids, and may reuse a dead message's). Either would otherwise
-- fail the whole statement and move nothing else, also when the producer
-- or the removal has not committed yet.
--
-- A dead letter whose id is live in the statement's snapshot is left
-- alone, unlocked: its live message may be dying at this moment, and the
-- dead-lettering, which deletes the message and then writes its dead
-- letter, would wait for a lock of ours while ours waited for its delete.
-- The others are locked, so that a concurrent redrive skips what this one
-- moves; a consumer that is there is locked against removal until this
-- commits; and an insert that meets an id that went live since the
-- snapshot, committed or not, does nothing. That covers ids live when
-- the statement began: a message that a producer enqueues under a dead id
-- after it began, and that dies while it runs, can still make the two wait
-- for each other. PostgreSQL then fails one with a deadlock (40P01),
-- nothing lost: the dead-lettering is retried (a deadlock is transient to
-- the outcome writer), and the redrive returns an error that says to
-- retry it (deadOpError).
--
-- They are locked in key order (id, app_id, source), as dead_purge.sql
-- locks, not in the order the plan reads them: a by-queue selection reads
-- idx_dead_letters_queue, in died_at order, an app-wide one the table or
-- idx_dead_letters_died, in another. Two overlapping redrives or purges
-- that each locked in their own order waited for each other, and
-- PostgreSQL failed one with a deadlock (40P01). The sort is of the
-- batch only, after the plan has found it.
--
-- One statement moves a batch of at most @batch dead letters, newest
-- first (died_at descending, then id and source ascending), and
-- Client.Redrive runs it until a batch comes up short, with a plan made
-- for each statement's arguments (pgx.QueryExecModeExec), since the plan
-- depends on which of id and queue are given. Each statement starts after
-- the last one's last dead letter (@after_*), and takes only dead letters
-- that died by @before, the first statement's now(), so that one that
-- died during the redrive (a redriven message failing again, say) is not
-- taken again. Unbounded, a redrive of 200,000 held its locks 14 s and
-- any timeout threw all of it away; and since the insert trigger takes a
-- shared advisory lock on each queue it inserts into, held to the end of
-- the transaction, one statement for an app's 150,000 queues overran the
-- server's lock table ("out of shared memory"). A batch is read in the
-- order of idx_dead_letters_died (by app) or idx_dead_letters_queue (by
-- queue), from @after_died down, sorted further only within a died_at.
WITH cand AS (
    SELECT d.id, d.app_id, d.source, d.died_at,
           CASE WHEN d.source = 'queue'
                THEN EXISTS (SELECT 1 FROM queue_messages m WHERE m.id = d.id)
                ELSE EXISTS (SELECT 1 FROM outbox o WHERE o.id = d.id) END AS id_live
    FROM dead_letters d
    -- The app's id as a value rather than a join, so that the plan reads
    -- the index in order under the LIMIT, not all the app's rows.
    WHERE d.app_id = (SELECT id FROM apps WHERE name = @app_name)
      AND (@id::uuid IS NULL OR d.id = @id)
      AND (@queue_name::text IS NULL OR d.queue_name = @queue_name)
      -- The bound on died_at alone, as a plain condition, which the
      -- index takes: within "@after_died IS NULL OR ..." the plan read
      -- all of a queue's dead letters for every batch. The rest of the
      -- cursor, for ties on died_at, filters. One selected by id is
      -- taken whenever it died.
      AND d.died_at <= least(coalesce(@before::timestamptz, CASE WHEN @id::uuid IS NULL THEN now() ELSE 'infinity' END),
                             coalesce(@after_died::timestamptz, 'infinity'))
      AND NOT coalesce(d.died_at = @after_died::timestamptz AND (d.id, d.source) <= (@after_id::uuid, @after_source::text), false)
    ORDER BY d.died_at DESC, d.id, d.source
    LIMIT @batch
), sel AS (
    SELECT d.id, d.app_id, d.source, d.queue_name, d.trigger_id, d.payload, d.max_attempts, d.enqueued_by_principal,
           CASE WHEN d.redrive_after > now() THEN d.redrive_after END AS deliver_after,
           d.source = 'invoke'
               AND NOT EXISTS (SELECT 1 FROM triggers t WHERE t.id = d.trigger_id FOR KEY SHARE) AS consumer_gone
    FROM dead_letters d
    JOIN cand c ON c.id = d.id AND c.app_id = d.app_id AND c.source = d.source
    WHERE NOT c.id_live
    ORDER BY d.id, d.app_id, d.source
    FOR UPDATE OF d
), q AS (
    INSERT INTO queue_messages (id, app_id, queue_name, payload, enqueued_at, deliver_after, max_attempts, enqueued_by_principal)
    SELECT id, app_id, queue_name, payload, now(), deliver_after, max_attempts, enqueued_by_principal
    FROM sel WHERE source = 'queue'
    ON CONFLICT (id) DO NOTHING
    RETURNING id, app_id
), o AS (
    INSERT INTO outbox (id, app_id, source_kind, trigger_id, payload, enqueued_at, deliver_after, max_attempts)
    SELECT id, app_id, 'invoke', trigger_id, payload, now(), deliver_after, max_attempts
    FROM sel WHERE source = 'invoke' AND NOT consumer_gone
    ON CONFLICT (id) DO NOTHING
    RETURNING id, app_id
), moved AS (
    DELETE FROM dead_letters d
    USING (SELECT id, app_id, 'queue'::text AS source FROM q
           UNION ALL SELECT id, app_id, 'invoke' FROM o) m
    WHERE d.id = m.id AND d.app_id = m.app_id AND d.source = m.source
    RETURNING 1
)
SELECT (SELECT count(*) FROM moved) AS moved,
       (SELECT count(*) FROM sel WHERE consumer_gone) AS consumer_gone,
       (SELECT count(*) FROM cand WHERE id_live)
         + (SELECT count(*) FROM sel WHERE NOT consumer_gone) - (SELECT count(*) FROM moved) AS id_live,
       (SELECT count(*) FROM cand) AS batch,
       coalesce(@before::timestamptz, now()) AS before,
       last.died_at, last.id, last.source
FROM (SELECT NULL) one
LEFT JOIN (SELECT died_at, id, source FROM cand ORDER BY died_at, id DESC, source DESC LIMIT 1) last ON true
