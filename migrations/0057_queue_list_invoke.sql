-- The queue list counts everything filed under a queue: its messages and
-- its consumer's invoke deliveries, pending and dead, as `dead ls`,
-- `redrive` and `purge --queue` select them. It counted the messages only,
-- so bellhop queues and bellhop_queue_messages showed an empty queue, and
-- a dead count of 0, while its consumer's invoke deliveries waited or
-- died, and less than a purge of the queue deletes. The base system's
-- outbox rows are not Bellhop's, and are left out. Otherwise 0039's view.
CREATE OR REPLACE VIEW queue_list AS
WITH pending AS (
    SELECT app_id, queue_name, claim_token, deliver_after, enqueued_at FROM queue_messages
    UNION ALL
    SELECT o.app_id, d.queue_name, o.claim_token, o.deliver_after, o.enqueued_at
    FROM outbox o
    JOIN queue_trigger_details d ON d.trigger_id = o.trigger_id
    WHERE o.source_kind = 'invoke'
), live AS (
    SELECT app_id, queue_name,
           count(*) FILTER (WHERE claim_token IS NULL AND (deliver_after IS NULL OR deliver_after <= now())) AS ready,
           count(*) FILTER (WHERE claim_token IS NULL AND deliver_after > now()) AS delayed,
           count(*) FILTER (WHERE claim_token IS NOT NULL) AS in_flight,
           -- A message is ready from the later of its enqueue and its deliver_after.
           min(greatest(enqueued_at, deliver_after))
               FILTER (WHERE claim_token IS NULL AND (deliver_after IS NULL OR deliver_after <= now())) AS oldest_ready_at
    FROM pending
    GROUP BY app_id, queue_name
), dead AS (
    SELECT app_id, queue_name, count(*) AS dead
    FROM dead_letters
    GROUP BY app_id, queue_name
), consumer AS (
    SELECT app_id, queue_name, id AS consumer_id, enabled FROM queue_consumers
), queues AS (
    SELECT app_id, queue_name FROM live
    UNION SELECT app_id, queue_name FROM dead
    UNION SELECT app_id, queue_name FROM consumer
)
SELECT a.name AS app_name,
       q.app_id,
       q.queue_name,
       coalesce(l.ready, 0) AS ready,
       coalesce(l.delayed, 0) AS delayed,
       coalesce(l.in_flight, 0) AS in_flight,
       coalesce(d.dead, 0) AS dead,
       now() - l.oldest_ready_at AS oldest_ready_age,
       c.consumer_id,
       c.enabled AS consumer_enabled
FROM queues q
JOIN apps a ON a.id = q.app_id
LEFT JOIN live l ON l.app_id = q.app_id AND l.queue_name = q.queue_name
LEFT JOIN dead d ON d.app_id = q.app_id AND d.queue_name = q.queue_name
LEFT JOIN consumer c ON c.app_id = q.app_id AND c.queue_name = q.queue_name;
