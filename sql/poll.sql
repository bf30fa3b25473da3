-- The fallback poll, one statement per interval for the whole dispatcher:
--   * sends the dispatcher's heartbeat on the wake-up channel, so the
--     listener's watchdog can tell a live connection from a hung one;
--   * lists the enabled queue consumers whose queue, or whose invoke_async
--     outbox, holds a message claimable now (one EXISTS probe each on the
--     dispatch partial indexes, stopping at the first ready row);
--   * reports when the next live lease expires, so the reclaim timer also
--     covers claims made by other dispatchers, crashed ones included;
--   * extends the dispatcher's offers (migrations/0044_lease_at_insert.sql)
--     of @offers, deletes its others (a stopped or paused lane's; not
--     those younger than a few seconds, which it may have made after
--     listing @offers) and
--     those of dispatchers gone for an hour, and returns the tokens still
--     on offer: one of @offers missing from them was taken, or lost with
--     the UNLOGGED table. Both skip offers a producer has locked, since
--     that producer is taking the offer and may not commit for a while;
--   * reads the database's clock, which bounds again how far it is ahead
--     of the dispatcher's for the offers still out (offers.go, afterPoll).
-- It writes only offers, and sends the NOTIFY, delivered at commit.
WITH refreshed AS (
    UPDATE bellhop_offers AS o
    SET expires_at = now() + make_interval(secs => @offer_ttl_ms::float8 / 1000)
    WHERE o.token IN (SELECT token FROM bellhop_offers
                      WHERE owner = @owner AND token = ANY(@offers::uuid[])
                      FOR UPDATE SKIP LOCKED)
    RETURNING o.token
), forgotten AS (
    DELETE FROM bellhop_offers AS o
    WHERE o.token IN (SELECT token FROM bellhop_offers
                      -- Ours that we no longer hold, unless made in the
                      -- last seconds: the dispatcher may have made it
                      -- after it listed @offers.
                      WHERE (owner = @owner AND NOT token = ANY(@offers::uuid[])
                             AND expires_at < now() + make_interval(secs => @offer_ttl_ms::float8 / 1000) - interval '5 seconds')
                         OR expires_at < now() - interval '1 hour'
                      FOR UPDATE SKIP LOCKED)
)
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
       bellhop_next_lease_expiry(@default_vt_secs) AS next_lease_expiry,
       ARRAY(SELECT token FROM refreshed) AS live_offers,
       clock_timestamp() AS db_now
