-- What a dispatcher needs to know to sleep well, read in the same
-- transaction as its claim of one queue (claim_queue.sql). For several,
-- next_due_queues.sql reads the same, a row per queue, which its first
-- column numbers; here that column is 1:
--   * the earliest future deliver_after of the queue's unclaimed messages,
--     to sleep on a timer until exactly then (idx_queue_messages_delayed);
--   * the latest live busy-mark lease another dispatcher holds on the
--     queue, to look again when it ends; and, unless @held (this
--     dispatcher holds the queue's busy key itself), whether another
--     session holds the busy key that producers test (busy_hold.sql): a
--     hung dispatcher's key can outlive its row's lease until
--     idle_session_timeout ends its session, and producers stay silent
--     until then, so that counts as a mark whose lease ends @lease_ms from
--     now (the shared try is transaction-scoped: it ends with this
--     statement);
--   * whether ready, unclaimed messages remain: after a claim that did not
--     fill its slots, they are rows another claim had locked (SKIP LOCKED
--     passed them over); if that claim dies, nobody announces them again,
--     so the dispatcher looks again shortly;
--   * the visibility timeout of the dispatcher's consumer of the queue
--     (@consumer_id), which the claimed messages' leases are measured with
--     (NULL if it no longer serves the queue: the dispatcher releases what
--     it claimed). Read after the claim, it is one the reclaim honours for
--     them even if the timeout is lowered or the consumer removed later
--     (migration 0047), while the dispatcher's copy may be one reload
--     behind. By primary key, so it costs next to nothing;
--   * the database's clock, so that the dispatcher turns the times above
--     into its own clock's: a timer armed on a database time would fire
--     as late as the database's clock is ahead of the dispatcher's.
-- Whether ready messages remain is read as claims find them (0064): the
-- oldest immediate message, or the earliest due delayed one, each the
-- first row of its index's order rather than EXISTS, so that each walks
-- its index instead of scanning claimed rows.
-- Read-only; a stale answer only makes the dispatcher look again early.
SELECT 1,
       (SELECT min(deliver_after)
        FROM queue_messages
        WHERE app_id = @app_id
          AND queue_name = @queue_name
          AND claim_token IS NULL
          AND deliver_after > now()),
       GREATEST((SELECT max(lease_until)
                 FROM queue_busy
                 WHERE app_id = @app_id AND queue_name = @queue_name
                   AND owner <> @owner AND lease_until > clock_timestamp()),
                CASE WHEN NOT @held::bool
                      AND NOT pg_try_advisory_xact_lock_shared(hashtextextended(@app_id::uuid::text || ':' || @queue_name::text, 1650814062))
                     THEN clock_timestamp() + @lease_ms * interval '1 millisecond'
                END),
       (SELECT enqueued_at
               FROM queue_messages
               WHERE app_id = @app_id
                 AND queue_name = @queue_name
                 AND claim_token IS NULL
                 AND deliver_after IS NULL
        ORDER BY enqueued_at
        LIMIT 1) IS NOT NULL
       OR (SELECT deliver_after
                  FROM queue_messages
                  WHERE app_id = @app_id
                    AND queue_name = @queue_name
                    AND claim_token IS NULL
                    AND deliver_after <= now()
           ORDER BY deliver_after
           LIMIT 1) IS NOT NULL,
       (SELECT visibility_timeout_secs FROM queue_trigger_details
        WHERE trigger_id = @consumer_id AND queue_name = @queue_name),
       clock_timestamp()
