-- The fallback poll, one statement per interval for the whole dispatcher:
--   * sends the dispatcher's heartbeat on the wake-up channel, so the
--     listener's watchdog can tell a live connection from a hung one;
--   * lists the enabled queue consumers whose queue, or whose invoke_async
--     outbox, holds a message claimable now (probes of the indexes claims
--     read, 0064: the oldest immediate message, or the earliest due
--     delayed one, each written as the first row in its index's order, not
--     EXISTS, so that a generic plan neither scans the table for it nor
--     hashes every ready message), and of
--     those the ones with a message claimable for @grace_ms already (its
--     deliver_after, or its enqueued_at if it has none, that long ago): only
--     these count as missed notifications. Work that came due just now may
--     be on its way to another dispatcher, whose own timer for a nack's or
--     a delayed message's due time fires at that moment, or whose
--     notification is still in flight;
--   * reports when the next live lease expires, so the reclaim timer also
--     covers claims made by other dispatchers, crashed ones included;
--   * extends the dispatcher's offers (migrations/0044_lease_at_insert.sql)
--     of @offers, deletes its others (a stopped or paused lane's; not
--     those younger than a few seconds, which it may have made after
--     listing @offers) and
--     those of dispatchers gone for an hour, and returns the tokens still
--     on offer: one of @offers missing from them was taken, or lost with
--     the UNLOGGED table. The extension and the deletion skip offers a
--     producer has locked, since that producer is taking the offer and
--     may not commit for a while; the tokens returned include them, as
--     they were in the statement's snapshot. A producer that commits sends
--     the lease's notification (and a lost one is recovered by the next
--     poll, which no longer finds the offer); one that rolls back leaves
--     the offer out, and had the dispatcher counted it taken, its lane
--     would have offered again and had two offers out;
--   * reads the database's clock: at the statement's start, which bounds
--     again how far it is ahead of the dispatcher's for the offers still
--     out (offers.go, timedRow and afterPoll), and at the end, against
--     which the next lease expiry is put on the dispatcher's clock.
-- It writes only offers, and sends the NOTIFY, delivered at commit.
WITH refreshed AS (
    UPDATE bellhop_offers AS o
    SET expires_at = now() + make_interval(secs => @offer_ttl_ms::float8 / 1000)
    WHERE o.token IN (SELECT token FROM bellhop_offers
                      WHERE owner = @owner AND token = ANY(@offers::uuid[])
                      FOR UPDATE SKIP LOCKED)
), queue_ready AS (
    SELECT c.id, c.app_id, c.queue_name
    FROM queue_consumers c
    WHERE c.enabled
      AND ((SELECT m.enqueued_at FROM queue_messages m
            WHERE m.app_id = c.app_id AND m.queue_name = c.queue_name
              AND m.claim_token IS NULL AND m.deliver_after IS NULL
            ORDER BY m.enqueued_at LIMIT 1) IS NOT NULL
           OR (SELECT m.deliver_after FROM queue_messages m
               WHERE m.app_id = c.app_id AND m.queue_name = c.queue_name
                 AND m.claim_token IS NULL AND m.deliver_after <= now()
               ORDER BY m.deliver_after LIMIT 1) IS NOT NULL)
), invoke_ready AS (
    SELECT c.id
    FROM queue_consumers c
    WHERE c.enabled
      AND ((SELECT m.enqueued_at FROM outbox m
            WHERE m.trigger_id = c.id AND m.source_kind = 'invoke'
              AND m.claim_token IS NULL AND m.deliver_after IS NULL
            ORDER BY m.enqueued_at LIMIT 1) IS NOT NULL
           OR (SELECT m.deliver_after FROM outbox m
               WHERE m.trigger_id = c.id AND m.source_kind = 'invoke'
                 AND m.claim_token IS NULL AND m.deliver_after <= now()
               ORDER BY m.deliver_after LIMIT 1) IS NOT NULL)
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
SELECT pg_notify('bellhop', @heartbeat::text) IS NOT NULL AS heartbeat_sent,
       ARRAY(SELECT id FROM queue_ready) AS queue_ready,
       ARRAY(SELECT r.id FROM queue_ready r
             WHERE (SELECT m.enqueued_at FROM queue_messages m
                    WHERE m.app_id = r.app_id AND m.queue_name = r.queue_name
                      AND m.claim_token IS NULL AND m.deliver_after IS NULL
                      AND m.enqueued_at <= now() - @grace_ms * interval '1 millisecond'
                    ORDER BY m.enqueued_at LIMIT 1) IS NOT NULL
                OR (SELECT m.deliver_after FROM queue_messages m
                    WHERE m.app_id = r.app_id AND m.queue_name = r.queue_name
                      AND m.claim_token IS NULL
                      AND m.deliver_after <= now() - @grace_ms * interval '1 millisecond'
                    ORDER BY m.deliver_after LIMIT 1) IS NOT NULL
       ) AS queue_stale,
       ARRAY(SELECT id FROM invoke_ready) AS invoke_ready,
       ARRAY(SELECT r.id FROM invoke_ready r
             WHERE (SELECT m.enqueued_at FROM outbox m
                    WHERE m.trigger_id = r.id AND m.source_kind = 'invoke'
                      AND m.claim_token IS NULL AND m.deliver_after IS NULL
                      AND m.enqueued_at <= now() - @grace_ms * interval '1 millisecond'
                    ORDER BY m.enqueued_at LIMIT 1) IS NOT NULL
                OR (SELECT m.deliver_after FROM outbox m
                    WHERE m.trigger_id = r.id AND m.source_kind = 'invoke'
                      AND m.claim_token IS NULL
                      AND m.deliver_after <= now() - @grace_ms * interval '1 millisecond'
                    ORDER BY m.deliver_after LIMIT 1) IS NOT NULL
       ) AS invoke_stale,
       bellhop_next_lease_expiry(@default_vt_secs) AS next_lease_expiry,
       ARRAY(SELECT token FROM bellhop_offers
             WHERE owner = @owner AND token = ANY(@offers::uuid[])) AS live_offers,
       statement_timestamp() AS db_start,
       clock_timestamp() AS db_now
