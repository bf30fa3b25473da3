-- A queue consumer's visibility timeout and push timeout, with its rows
-- locked until the transaction ends. An update that changes one of the
-- two checks that the pair it leaves still fits (a push must end before
-- its lease) against values no concurrent update can change before it
-- writes. The consumer's triggers row is locked first, then its details,
-- the order in which consumer_update.sql and a removal's cascade lock
-- them: the other order deadlocked with a concurrent pause or removal.
WITH t AS (
    SELECT id FROM triggers
    WHERE id = @id AND kind = 'queue' AND app_id = @app_id
    FOR NO KEY UPDATE
)
SELECT d.visibility_timeout_secs, d.push_timeout_ms
FROM queue_trigger_details AS d
WHERE d.trigger_id = (SELECT id FROM t)
FOR UPDATE OF d
