-- A message's times are finite. PostgreSQL stores 'infinity' and
-- '-infinity', which a producer's plain INSERT could set (docs/roles.sql
-- lets it set enqueued_at and deliver_after), but Go's time.Time cannot
-- hold them: the claim that leased such a row failed to read it, after its
-- lease had committed, and so did the next-due read beside it. Every pass
-- a second later leased more of the queue and failed again, spending the
-- attempts of every message in it undelivered, and the queue_list view
-- (bellhop queues, the depth metrics) failed for every app.
--
-- Rows already stored are mended first, none lost: an infinite enqueued_at
-- becomes now(); a deliver_after of -infinity becomes NULL (deliverable
-- now, which it was), and one of infinity the furthest time enqueue()
-- accepts, 3650 days on. Of the outbox the invoke deliveries only are
-- covered: the other kinds belong to the base system. A NULL deliver_after
-- passes the CHECK, as NULL does.
--
-- Such a message that ran out of attempts was dead-lettered with its times,
-- which then failed dead ls and, once constrained here, its redrive: its
-- dead letter is mended the same way.
--
-- Both tables are locked first, in one order, as 0050 does and for its
-- reason.
LOCK TABLE queue_messages, outbox IN ACCESS EXCLUSIVE MODE;

UPDATE queue_messages
SET enqueued_at = CASE WHEN isfinite(enqueued_at) THEN enqueued_at ELSE now() END,
    deliver_after = CASE WHEN isfinite(deliver_after) THEN deliver_after
                         WHEN deliver_after > now() THEN now() + interval '3650 days' END
WHERE NOT isfinite(enqueued_at) OR NOT isfinite(deliver_after);

UPDATE outbox
SET enqueued_at = CASE WHEN isfinite(enqueued_at) THEN enqueued_at ELSE now() END,
    deliver_after = CASE WHEN isfinite(deliver_after) THEN deliver_after
                         WHEN deliver_after > now() THEN now() + interval '3650 days' END
WHERE source_kind = 'invoke' AND (NOT isfinite(enqueued_at) OR NOT isfinite(deliver_after));

UPDATE dead_letters
SET enqueued_at = CASE WHEN isfinite(enqueued_at) THEN enqueued_at ELSE now() END,
    deliver_after = CASE WHEN isfinite(deliver_after) THEN deliver_after
                         WHEN deliver_after > now() THEN now() + interval '3650 days' END
WHERE NOT isfinite(enqueued_at) OR NOT isfinite(deliver_after);

-- Dropped first, so that the file can run again, as those since 0052 can.
ALTER TABLE queue_messages
    DROP CONSTRAINT IF EXISTS queue_messages_enqueued_at_finite_check,
    DROP CONSTRAINT IF EXISTS queue_messages_deliver_after_finite_check,
    ADD CONSTRAINT queue_messages_enqueued_at_finite_check CHECK (isfinite(enqueued_at)),
    ADD CONSTRAINT queue_messages_deliver_after_finite_check CHECK (isfinite(deliver_after));

ALTER TABLE outbox
    DROP CONSTRAINT IF EXISTS outbox_times_finite_check,
    ADD CONSTRAINT outbox_times_finite_check
        CHECK (source_kind <> 'invoke' OR (isfinite(enqueued_at) AND isfinite(deliver_after) IS NOT FALSE));
