-- Deletes dead letters for good: by id, or every one of an app's queue,
-- or every one of an app's.
--
-- The selected dead letters are locked first, in key order (id, app_id,
-- source), as dead_redrive.sql locks them, and then deleted. A DELETE
-- alone locked them in the order its plan read them: died_at order for a
-- queue (idx_dead_letters_queue), the table's order or another for a
-- whole app, and two overlapping purges or redrives that locked in
-- different orders deadlocked (40P01), failing one. One that a
-- concurrent redrive or purge took first is skipped once that commits.
-- The rows locked are found again by primary key (id = ANY, as in
-- reclaim.sql): joined on the key alone, the planner, expecting thousands,
-- hashed the whole table, every app's dead letters.
--
-- One statement deletes a batch of at most @batch, newest first, as
-- dead_redrive.sql moves them (and with a plan of its own, as there), and
-- Client.PurgeDead runs it until a batch comes up short: each lock is held for one batch, not for the whole
-- purge, so that a reclaim or an outcome that dead-letters a message
-- under a reused id, which waits for the lock on that id's dead letter,
-- waits for one batch at most.
WITH cand AS (
    SELECT d.id, d.app_id, d.source, d.died_at
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
    SELECT d.id, d.app_id, d.source
    FROM dead_letters d
    JOIN cand c ON c.id = d.id AND c.app_id = d.app_id AND c.source = d.source
    ORDER BY d.id, d.app_id, d.source
    FOR UPDATE OF d
), deleted AS (
    DELETE FROM dead_letters d
    USING sel
    WHERE d.id = ANY (ARRAY(SELECT id FROM sel))
      AND d.id = sel.id AND d.app_id = sel.app_id AND d.source = sel.source
    RETURNING 1
)
SELECT (SELECT count(*) FROM deleted) AS deleted,
       (SELECT count(*) FROM cand) AS batch,
       coalesce(@before::timestamptz, now()) AS before,
       last.died_at, last.id, last.source
FROM (SELECT NULL) one
LEFT JOIN (SELECT died_at, id, source FROM cand ORDER BY died_at, id DESC, source DESC LIMIT 1) last ON true
