-- A queue consumer's visibility timeout and push timeout, with its detail
-- row locked until the transaction ends. An update that changes one of the
-- two checks that the pair it leaves still fits (a push must end before
-- its lease) against values no concurrent update can change before it
-- writes.
SELECT d.visibility_timeout_secs, d.push_timeout_ms
FROM queue_trigger_details AS d
JOIN triggers AS t ON t.id = d.trigger_id
WHERE t.id = @id AND t.kind = 'queue' AND t.app_id = @app_id
FOR UPDATE OF d
