-- Messages whose attempts are exhausted, or that a consumer rejected for
-- good, move here in the same transaction that removes them from
-- queue_messages (or outbox). The row keeps the message's columns, the last
-- error and when the message died; redrive moves it back.
CREATE TABLE dead_letters (
    id                    UUID PRIMARY KEY,
    source                TEXT NOT NULL
                          CONSTRAINT dead_letters_source_check CHECK (source IN ('queue', 'invoke')),
    app_id                UUID NOT NULL REFERENCES apps(id) ON DELETE CASCADE,
    queue_name            TEXT NOT NULL,
    -- For source 'invoke': the consumer the delivery was addressed to.
    trigger_id            UUID NULL,
    payload               JSONB NOT NULL,
    enqueued_at           TIMESTAMPTZ NOT NULL,
    deliver_after         TIMESTAMPTZ NULL,
    attempt               INT NOT NULL,
    max_attempts          INT NOT NULL,
    enqueued_by_principal UUID NULL,
    last_error            TEXT NOT NULL,
    died_at               TIMESTAMPTZ NOT NULL DEFAULT now()
);

CREATE INDEX idx_dead_letters_queue ON dead_letters (app_id, queue_name, died_at);
