-- The reclaim reads only the leases that can have ended, and the next
-- lease expiry only those that can end first.
--
-- Both worked out the timeout of every lease in flight (bellhop_reclaim_vt,
-- bellhop_lease_end), so each reclaim pass and each fallback poll took
-- time in proportion to the leases in flight, however few had expired:
-- 0.61 s a pass with 100,000 in flight on the development cluster, now
-- 3.4 ms when they share one timeout (BENCHMARKS.md, "Reclaim reads only
-- old leases").
--
-- No lease ends before its claim plus bellhop_min_vt: a lease's timeout is
-- its consumer's, or the default for a queue with no consumer, and a floor
-- (0047, 0059) only makes it longer. So a lease claimed since
-- now() - bellhop_min_vt has not ended, and the reclaim reads only the
-- older ones, through idx_queue_messages_claimed (sql/reclaim.sql); the
-- seed built that index for this scan.
--
-- The index below makes bellhop_min_vt one index probe, however many
-- consumers there are. It costs the consumers' writes only: the hot one,
-- last_fired_at, stays a HOT update.
CREATE INDEX IF NOT EXISTS idx_queue_trigger_details_vt ON queue_trigger_details (visibility_timeout_secs);

CREATE OR REPLACE FUNCTION bellhop_min_vt(p_default_vt_secs INT) RETURNS INT
LANGUAGE sql STABLE AS $$
    SELECT least(p_default_vt_secs, (SELECT min(visibility_timeout_secs) FROM queue_trigger_details))
$$;

-- The next lease expiry reads only leases claimed before the end of the
-- oldest one less bellhop_min_vt: a lease claimed later cannot end sooner.
-- When every consumer's timeout is the default, that is no lease at all,
-- and it costs two index probes; otherwise the leases claimed within the
-- longest timeout less the shortest after the oldest one, which can be
-- all of them. Of those it takes each queue's oldest, since a lease's end
-- (bellhop_lease_end) only grows with its claim, and works out the end of
-- that one alone: with 100,000 in flight under two timeouts, a pass
-- (this and the reclaim) takes 24 ms rather than 0.62 s. Otherwise
-- 0059's function, and the same answer: should a queue ever have two
-- consumers (a direct UPDATE of queue_trigger_details), the shorter
-- timeout counts, as there. The window's end is worked out first, so
-- that the statement that reads the window is planned with its value.
CREATE OR REPLACE FUNCTION bellhop_next_lease_expiry(p_default_vt_secs INT) RETURNS TIMESTAMPTZ
LANGUAGE plpgsql STABLE AS $$
DECLARE
    oldest         TIMESTAMPTZ;
    claimed_before TIMESTAMPTZ;
    queues         TIMESTAMPTZ;
    invokes        TIMESTAMPTZ;
BEGIN
    SELECT least(
        (SELECT min(bellhop_lease_end(m.app_id, m.queue_name,
                    coalesce(c.visibility_timeout_secs, p_default_vt_secs), m.claimed_at))
         FROM (SELECT app_id, queue_name, claimed_at FROM queue_messages
               WHERE claim_token IS NOT NULL ORDER BY claimed_at LIMIT 1) AS m
         LEFT JOIN queue_consumers c ON c.app_id = m.app_id AND c.queue_name = m.queue_name),
        (SELECT min(bellhop_lease_end(m.app_id, c.queue_name,
                    coalesce(c.visibility_timeout_secs, p_default_vt_secs), m.claimed_at))
         FROM (SELECT app_id, trigger_id, claimed_at FROM outbox
               WHERE claim_token IS NOT NULL AND source_kind = 'invoke' ORDER BY claimed_at LIMIT 1) AS m
         LEFT JOIN queue_consumers c ON c.id = m.trigger_id))
    INTO oldest;
    IF oldest IS NULL THEN
        RETURN NULL;
    END IF;
    claimed_before := oldest - make_interval(secs => bellhop_min_vt(p_default_vt_secs));
    SELECT min(bellhop_lease_end(m.app_id, m.queue_name,
               coalesce(c.visibility_timeout_secs, p_default_vt_secs), m.claimed_at))
    FROM (SELECT app_id, queue_name, min(claimed_at) AS claimed_at
          FROM queue_messages
          WHERE claim_token IS NOT NULL AND claimed_at < claimed_before
          GROUP BY app_id, queue_name) AS m
    LEFT JOIN queue_consumers c ON c.app_id = m.app_id AND c.queue_name = m.queue_name
    INTO queues;
    SELECT min(bellhop_lease_end(m.app_id, c.queue_name,
               coalesce(c.visibility_timeout_secs, p_default_vt_secs), m.claimed_at))
    FROM (SELECT app_id, trigger_id, min(claimed_at) AS claimed_at
          FROM outbox
          WHERE claim_token IS NOT NULL AND source_kind = 'invoke' AND claimed_at < claimed_before
          GROUP BY app_id, trigger_id) AS m
    LEFT JOIN queue_consumers c ON c.id = m.trigger_id
    INTO invokes;
    RETURN least(oldest, queues, invokes);
END
$$;
