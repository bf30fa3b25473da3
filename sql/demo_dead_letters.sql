-- How many dead letters `bellhop demo` left in its queue in one run: its
-- messages carry the run's id in their payload ("run"), since a database
-- given by DATABASE_URL keeps earlier runs' dead letters.
SELECT count(*)
FROM dead_letters d JOIN apps a ON a.id = d.app_id
WHERE a.name = @app_name AND d.queue_name = @queue_name AND d.source = 'queue'
  AND d.payload->>'run' = @run
