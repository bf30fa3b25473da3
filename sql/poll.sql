-- The fallback poll, one statement per interval for the whole dispatcher:
--   * sends the dispatcher's heartbeat on the wake-up channel, so the
--     listener's watchdog can tell a live connection from a hung one;
--   * lists the enabled queue consumers whose queue, or whose invoke_async
--     outbox, holds a message claimable now (one EXISTS probe each on the
--     dispatch partial indexes, stopping at the first ready row);
--   * reports when the next live lease expires, so the reclaim timer also
--     covers claims made by other dispatchers, crashed ones included.
-- Read-only apart from the NOTIFY, which is delivered at commit.
SELECT pg_notify('bellhop', @heartbeat::text) IS NULL AS sent,
       ARRAY(
           SELECT c.id
           FROM queue_consumers c
           WHERE c.enabled
             AND EXISTS (SELECT 1 FROM queue_messages m
                         WHERE m.app_id = c.app_id AND m.queue_name = c.queue_name
                           AND m.claim_token IS NULL
                           AND (m.deliver_after IS NULL OR m.deliver_after <= now()))
       ) AS queue_ready,
       ARRAY(
           SELECT c.id
           FROM queue_consumers c
           WHERE c.enabled
             AND EXISTS (SELECT 1 FROM outbox m
                         WHERE m.trigger_id = c.id AND m.source_kind = 'invoke'
                           AND m.claim_token IS NULL
                           AND (m.deliver_after IS NULL OR m.deliver_after <= now()))
       ) AS invoke_ready,
       bellhop_next_lease_expiry(@default_vt_secs) AS next_lease_expiry
