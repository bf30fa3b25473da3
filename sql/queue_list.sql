-- The dashboard's queue table, optionally for one app.
SELECT app_name, queue_name, ready, delayed, in_flight, dead,
       extract(epoch FROM oldest_ready_age)::float8, consumer_id, consumer_enabled
FROM queue_list
WHERE (@app_name::text IS NULL OR app_name = @app_name)
ORDER BY app_name, queue_name
