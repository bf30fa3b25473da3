-- Which lanes to wake after the listener (re)connects, when notifications
-- sent while it was away reached nobody: the enabled consumers whose queue
-- holds an unclaimed message (ready, or delayed: the lane's pass sets its
-- timer), or carries another dispatcher's live busy mark (the lane must
-- watch it, since producers are silent while it lasts): a live row, or a
-- held busy key (busy_hold.sql), which can outlive its dispatcher's row if
-- that dispatcher hangs; ours too, which only costs a pass. The keys are
-- read from pg_locks once, not tried per consumer: ten thousand tries in
-- one transaction could exhaust the lock table. And, separately,
-- those whose invoke_async outbox holds an unclaimed message. One probe
-- each on the dispatch partial indexes and queue_busy's key. Waking every
-- lane instead would claim once per consumer and source: with ten thousand
-- queues, twenty thousand statements for a few that have work.
-- Read-only, but for @heartbeat: unless it is '' (or NULL), it is sent on the
-- wake-up channel, so that a listener that can never hear (LISTEN through
-- transaction pooling) is found within seconds of connecting rather than
-- at the fallback polls (notify.Listener.FirstHeartbeat). CASE, not OR,
-- so that pg_notify runs only then.
WITH busy_keys AS MATERIALIZED (
    -- A one-bigint advisory key shows as its high and low halves.
    SELECT (classid::bigint << 32) | objid::bigint AS key FROM pg_locks
    WHERE locktype = 'advisory' AND objsubid = 1 AND granted
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
)
SELECT ARRAY(
           SELECT c.id
           FROM queue_consumers c
           WHERE c.enabled
             AND (EXISTS (SELECT 1 FROM queue_messages m
                          WHERE m.app_id = c.app_id AND m.queue_name = c.queue_name
                            AND m.claim_token IS NULL)
                  OR EXISTS (SELECT 1 FROM queue_busy b
                             WHERE b.app_id = c.app_id AND b.queue_name = c.queue_name
                               AND b.owner <> @owner AND b.lease_until > clock_timestamp())
                  OR EXISTS (SELECT 1 FROM busy_keys k
                             WHERE k.key = hashtextextended(c.app_id::text || ':' || c.queue_name, 1650814062)))
       ) AS queue_lanes,
       ARRAY(
           SELECT c.id
           FROM queue_consumers c
           WHERE c.enabled
             AND EXISTS (SELECT 1 FROM outbox m
                         WHERE m.trigger_id = c.id AND m.source_kind = 'invoke'
                           AND m.claim_token IS NULL)
       ) AS invoke_lanes,
       CASE WHEN coalesce(@heartbeat::text, '') = '' THEN false
            ELSE pg_notify('bellhop', @heartbeat::text) IS NOT NULL END AS heartbeat_sent
