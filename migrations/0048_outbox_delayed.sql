-- Lets a claim pass of an invoke consumer find its next due deliver_after
-- with one index probe (next_due_invoke.sql), as idx_queue_messages_delayed
-- does for queues. Without it, when one consumer holds most of the outbox,
-- the planner reads the whole table on every pass: idx_outbox_dispatch
-- leads with the consumer but is ordered by enqueued_at, not deliver_after
-- (TestClaimPlan, "one queue").
CREATE INDEX idx_outbox_delayed
    ON outbox (trigger_id, deliver_after)
    WHERE claim_token IS NULL AND deliver_after IS NOT NULL;
