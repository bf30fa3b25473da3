-- The consumer of one queue, if any.
SELECT t.id
FROM triggers t JOIN queue_trigger_details d ON d.trigger_id = t.id
WHERE t.kind = 'queue' AND t.app_id = @app_id AND d.queue_name = @queue_name
