-- The queue list's dead count takes in every dead letter filed under the
-- queue: its messages' and its consumer's invoke deliveries', which
-- `dead ls`, `redrive` and `purge --queue` select too. It counted the
-- messages' only, so bellhop queues and bellhop_queue_messages{state="dead"}
-- showed 0 while invoke deliveries died, and less than a purge of the queue
-- deletes. Otherwise 0039's view.
CREATE OR REPLACE VIEW queue_list AS
WITH live AS (
    SELECT app_id, queue_name,
           count(*) FILTER (WHERE claim_token IS NULL AND (deliver_after IS NULL OR deliver_after <= now())) AS ready,
           count(*) FILTER (WHERE claim_token IS NULL AND deliver_after > now()) AS delayed,
           count(*) FILTER (WHERE claim_token IS NOT NULL) AS in_flight,
           -- A message is ready from the later of its enqueue and its deliver_after.
           min(greatest(enqueued_at, deliver_after))
               FILTER (WHERE claim_token IS NULL AND (deliver_after IS NULL OR deliver_after <= now())) AS oldest_ready_at
    FROM queue_messages
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
