-- The outbox is shared: its 'event' and 'cron' rows belong to the base
-- system's own dispatcher, which claims them with the same claim_token and
-- claimed_at columns. Bellhop serves only the 'invoke' rows (0035), and
-- its reclaim must leave the others alone: released under Bellhop's
-- default timeout, or moved to dead_letters as 'invoke' deliveries that
-- no lane would ever claim once redriven. sql/reclaim.sql filters on
-- source_kind; the next lease expiry, which sets the reclaim timer, does
-- the same here, so another system's long lease does not wake it.
-- Otherwise 0047's function.
CREATE OR REPLACE FUNCTION bellhop_next_lease_expiry(p_default_vt_secs INT) RETURNS TIMESTAMPTZ
LANGUAGE sql STABLE AS $$
    SELECT least(
        (SELECT min(m.claimed_at + make_interval(secs => bellhop_reclaim_vt(m.app_id, m.queue_name,
                    coalesce(c.visibility_timeout_secs, p_default_vt_secs))))
         FROM queue_messages m
         LEFT JOIN queue_consumers c ON c.app_id = m.app_id AND c.queue_name = m.queue_name
         WHERE m.claim_token IS NOT NULL),
        (SELECT min(m.claimed_at + make_interval(secs => bellhop_reclaim_vt(m.app_id, c.queue_name,
                    coalesce(c.visibility_timeout_secs, p_default_vt_secs))))
         FROM outbox m
         LEFT JOIN queue_consumers c ON c.id = m.trigger_id
         WHERE m.claim_token IS NOT NULL AND m.source_kind = 'invoke'))
$$;
