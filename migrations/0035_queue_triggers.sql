-- Queue consumers are triggers of kind 'queue'; invoke_async puts its
-- deliveries in the outbox with source_kind 'invoke'.
--
-- One consumer per (app_id, queue_name) is enforced where consumers are
-- registered, under pg_advisory_xact_lock on the pair: a unique index on
-- queue_trigger_details cannot include the parent trigger's app_id.

ALTER TABLE triggers
    DROP CONSTRAINT triggers_kind_check,
    ADD CONSTRAINT triggers_kind_check CHECK (kind IN ('http', 'cron', 'queue'));

ALTER TABLE outbox
    DROP CONSTRAINT outbox_source_kind_check,
    ADD CONSTRAINT outbox_source_kind_check CHECK (source_kind IN ('event', 'cron', 'invoke'));

-- The retry policy stays on the parent triggers row.
CREATE TABLE queue_trigger_details (
    trigger_id              UUID PRIMARY KEY REFERENCES triggers(id) ON DELETE CASCADE,
    queue_name              TEXT NOT NULL,
    visibility_timeout_secs INT NOT NULL DEFAULT 30,
    last_fired_at           TIMESTAMPTZ NULL
);

CREATE INDEX idx_queue_trigger_details_queue ON queue_trigger_details (queue_name);
