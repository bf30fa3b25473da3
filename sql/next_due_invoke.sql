-- The earliest future deliver_after of a consumer's unclaimed invoke_async
-- deliveries. See next_due_queue.sql; invoke deliveries are always
-- announced, so there is no busy mark to report.
SELECT (SELECT min(deliver_after)
        FROM outbox
        WHERE trigger_id = @trigger_id
          AND source_kind = 'invoke'
          AND claim_token IS NULL
          AND deliver_after > now()),
       NULL::timestamptz
