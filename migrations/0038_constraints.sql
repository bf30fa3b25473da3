-- Rules that hold whoever writes the rows, plain SQL included.
--
-- Queue names: 1 to 128 bytes of [A-Za-z0-9._:-] (ASCII, so bytes = chars).
-- Attempts: max_attempts from 1 to 1000, attempt never negative.
-- Payloads: at most 1 MiB (1048576 bytes) as PostgreSQL prints the jsonb
-- value, which is the form consumers receive.

ALTER TABLE queue_messages
    ADD CONSTRAINT queue_messages_queue_name_check
        CHECK (queue_name ~ '^[A-Za-z0-9._:-]{1,128}$'),
    ADD CONSTRAINT queue_messages_max_attempts_check
        CHECK (max_attempts BETWEEN 1 AND 1000),
    ADD CONSTRAINT queue_messages_attempt_check
        CHECK (attempt >= 0),
    ADD CONSTRAINT queue_messages_payload_size_check
        CHECK (octet_length(payload::text) <= 1048576);

ALTER TABLE outbox
    ADD CONSTRAINT outbox_max_attempts_check
        CHECK (max_attempts BETWEEN 1 AND 1000),
    ADD CONSTRAINT outbox_attempt_check
        CHECK (attempt >= 0),
    ADD CONSTRAINT outbox_payload_size_check
        CHECK (octet_length(payload::text) <= 1048576);

ALTER TABLE queue_trigger_details
    ADD CONSTRAINT queue_trigger_details_queue_name_check
        CHECK (queue_name ~ '^[A-Za-z0-9._:-]{1,128}$'),
    ADD CONSTRAINT queue_trigger_details_visibility_timeout_check
        CHECK (visibility_timeout_secs BETWEEN 1 AND 43200),
    -- How many of this consumer's messages may be handled at once, per
    -- dispatcher process.
    ADD COLUMN max_in_flight INT NOT NULL DEFAULT 10
        CONSTRAINT queue_trigger_details_max_in_flight_check CHECK (max_in_flight BETWEEN 1 AND 10000);

-- Lets a dispatcher find a queue's next due deliver_after with one index
-- probe, so it can sleep on a timer until then.
CREATE INDEX idx_queue_messages_delayed
    ON queue_messages (app_id, queue_name, deliver_after)
    WHERE claim_token IS NULL AND deliver_after IS NOT NULL;
