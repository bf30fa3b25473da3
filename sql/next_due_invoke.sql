-- The earliest future deliver_after of a consumer's unclaimed invoke_async
-- deliveries, whether ready, unclaimed ones remain, and the consumer's
-- visibility timeout, and the database's clock (see next_due_queue.sql). Invoke deliveries are always announced, so there is
-- no busy mark to report.
SELECT (SELECT min(deliver_after)
        FROM outbox
        WHERE trigger_id = @trigger_id
          AND source_kind = 'invoke'
          AND claim_token IS NULL
          AND deliver_after > now()),
       NULL::timestamptz,
       (SELECT enqueued_at
               FROM outbox
               WHERE trigger_id = @trigger_id
                 AND source_kind = 'invoke'
                 AND claim_token IS NULL
                 AND deliver_after IS NULL
        ORDER BY enqueued_at
        LIMIT 1) IS NOT NULL
       OR (SELECT deliver_after
                  FROM outbox
                  WHERE trigger_id = @trigger_id
                    AND source_kind = 'invoke'
                    AND claim_token IS NULL
                    AND deliver_after <= now()
           ORDER BY deliver_after
           LIMIT 1) IS NOT NULL,
       (SELECT visibility_timeout_secs FROM queue_trigger_details WHERE trigger_id = @trigger_id),
       clock_timestamp()
