-- next_due_queue.sql for several queues, read in the same transaction
-- as their claim (claim_queues.sql): one row per queue (app_ids[i],
-- queue_names[i]), numbered i, whose consumer is consumer_ids[i] and
-- whose busy key the dispatcher holds if held[i]. next_due_queue.sql says
-- what each column is for and why reading it is safe.
SELECT q.i,
       (SELECT min(deliver_after)
        FROM queue_messages
        WHERE app_id = q.app_id
          AND queue_name = q.queue_name
          AND claim_token IS NULL
          AND deliver_after > now()),
       GREATEST((SELECT max(lease_until)
                 FROM queue_busy
                 WHERE app_id = q.app_id AND queue_name = q.queue_name
                   AND owner <> @owner AND lease_until > clock_timestamp()),
                CASE WHEN NOT q.held
                      AND NOT pg_try_advisory_xact_lock_shared(hashtextextended(q.app_id::text || ':' || q.queue_name, 1650814062))
                     THEN clock_timestamp() + @lease_ms * interval '1 millisecond'
                END),
       (SELECT enqueued_at
               FROM queue_messages
               WHERE app_id = q.app_id
                 AND queue_name = q.queue_name
                 AND claim_token IS NULL
                 AND deliver_after IS NULL
        ORDER BY enqueued_at
        LIMIT 1) IS NOT NULL
       OR (SELECT deliver_after
                  FROM queue_messages
                  WHERE app_id = q.app_id
                    AND queue_name = q.queue_name
                    AND claim_token IS NULL
                    AND deliver_after <= now()
           ORDER BY deliver_after
           LIMIT 1) IS NOT NULL,
       (SELECT visibility_timeout_secs FROM queue_trigger_details
        WHERE trigger_id = q.consumer_id AND queue_name = q.queue_name),
       clock_timestamp()
FROM unnest(@app_ids::uuid[], @queue_names::text[], @consumer_ids::uuid[], @held::bool[])
     WITH ORDINALITY AS q (app_id, queue_name, consumer_id, held, i)
