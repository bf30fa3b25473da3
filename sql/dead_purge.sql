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
WITH sel AS (
    SELECT d.id, d.app_id, d.source
    FROM dead_letters d
    JOIN apps a ON a.id = d.app_id
    WHERE a.name = @app_name
      AND (@id::uuid IS NULL OR d.id = @id)
      AND (@queue_name::text IS NULL OR d.queue_name = @queue_name)
    ORDER BY d.id, d.app_id, d.source
    FOR UPDATE OF d
)
DELETE FROM dead_letters d
USING sel
WHERE d.id = ANY (ARRAY(SELECT id FROM sel))
  AND d.id = sel.id AND d.app_id = sel.app_id AND d.source = sel.source
RETURNING d.id
