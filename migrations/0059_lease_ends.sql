-- When a lease really ends, in two places that measured it too late or not
-- at all.
--
-- 1. The reclaim timer. A lease taken after a consumer's timeout was
-- lowered is measured with the new timeout, but the reclaim keeps the old
-- one as the queue's floor while the floor lasts (0047): such a lease is
-- reclaimable once both its own timeout has run and either the floor's
-- timeout has run too or the floor has ended. bellhop_next_lease_expiry
-- measured it with the floor's timeout whatever the floor's end, so a
-- lease taken near that end, whose consumer then died, was reported up to
-- the old timeout (12 hours at most) later than the reclaim would take
-- it, and every reclaimer's timer slept until then. bellhop_lease_end is
-- the reclaim's own rule (sql/reclaim.sql, bellhop_reclaim_vt) turned into
-- a time; a pending floor's end is 'infinity', so it counts in full.
CREATE OR REPLACE FUNCTION bellhop_lease_end(p_app_id UUID, p_queue_name TEXT, p_vt_secs INT, p_claimed_at TIMESTAMPTZ)
RETURNS TIMESTAMPTZ
LANGUAGE sql STABLE AS $$
    SELECT GREATEST(p_claimed_at + make_interval(secs => p_vt_secs),
                    (SELECT LEAST(p_claimed_at + make_interval(secs => f.vt_secs), f.until)
                     FROM bellhop_vt_floors AS f
                     WHERE f.app_id = p_app_id AND f.queue_name = p_queue_name AND f.until > now()))
$$;

-- Otherwise 0049's function.
CREATE OR REPLACE FUNCTION bellhop_next_lease_expiry(p_default_vt_secs INT) RETURNS TIMESTAMPTZ
LANGUAGE sql STABLE AS $$
    SELECT least(
        (SELECT min(bellhop_lease_end(m.app_id, m.queue_name,
                    coalesce(c.visibility_timeout_secs, p_default_vt_secs), m.claimed_at))
         FROM queue_messages m
         LEFT JOIN queue_consumers c ON c.app_id = m.app_id AND c.queue_name = m.queue_name
         WHERE m.claim_token IS NOT NULL),
        (SELECT min(bellhop_lease_end(m.app_id, c.queue_name,
                    coalesce(c.visibility_timeout_secs, p_default_vt_secs), m.claimed_at))
         FROM outbox m
         LEFT JOIN queue_consumers c ON c.id = m.trigger_id
         WHERE m.claim_token IS NOT NULL AND m.source_kind = 'invoke'))
$$;

-- 2. Dead letters of work that may still run. A handler that gave up on
-- work that may still be running (an HTTP push left unanswered, a handler
-- cut off at its lease's end) is retried no earlier than its lease's end
-- (sql/nack.sql). On its last attempt it was dead-lettered, and a redrive
-- made it claimable at once: a second consumer could get it while the
-- first lease held. The dead letter now keeps that end, and a redrive
-- before it enqueues the message to be delivered then (sql/dead_letter.sql,
-- sql/dead_redrive.sql). NULL: nothing to wait for.
ALTER TABLE dead_letters ADD COLUMN IF NOT EXISTS redrive_after TIMESTAMPTZ NULL;

-- `dead ls --app` (sql/dead_list.sql) sorted the app's whole share of the
-- table to return its newest rows; idx_dead_letters_queue serves only a
-- listing by queue.
CREATE INDEX IF NOT EXISTS idx_dead_letters_died ON dead_letters (app_id, died_at DESC, id);
