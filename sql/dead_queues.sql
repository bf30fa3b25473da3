-- The names of the queues that hold an app's dead letters, in order, for
-- a redrive of the whole app, which moves them a few queues at a time
-- (dead_redrive.sql says why).
SELECT DISTINCT d.queue_name
FROM dead_letters d
JOIN apps a ON a.id = d.app_id
WHERE a.name = @app_name
ORDER BY 1
