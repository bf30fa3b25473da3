-- Base schema: the tables that the seed's migration 0034 assumes already
-- exist. Names and shapes follow the seed's design notes: apps own
-- principals, triggers (consumers of every kind) and outbox rows.

-- App and principal names: 1 to 63 bytes of [A-Za-z0-9._-], starting with a
-- letter or digit, so they are safe in URLs, logs and CLI arguments.
CREATE TABLE apps (
    id         UUID PRIMARY KEY DEFAULT gen_random_uuid(),
    name       TEXT NOT NULL UNIQUE
               CONSTRAINT apps_name_check CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$'),
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Principals are the identities that register consumers and enqueue.
-- (id, app_id) is unique so that other tables can require, with a foreign
-- key, that a principal belongs to the same app as the row that names it.
CREATE TABLE principals (
    id         UUID PRIMARY KEY DEFAULT gen_random_uuid(),
    app_id     UUID NOT NULL REFERENCES apps(id) ON DELETE CASCADE,
    name       TEXT NOT NULL
               CONSTRAINT principals_name_check CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$'),
    created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    UNIQUE (app_id, name),
    UNIQUE (id, app_id)
);

-- A trigger is a registered consumer. The retry policy lives here, for
-- every kind of trigger.
CREATE TABLE triggers (
    id              UUID PRIMARY KEY DEFAULT gen_random_uuid(),
    app_id          UUID NOT NULL REFERENCES apps(id) ON DELETE CASCADE,
    kind            TEXT NOT NULL
                    CONSTRAINT triggers_kind_check CHECK (kind IN ('http', 'cron')),
    principal_id    UUID NOT NULL,
    enabled         BOOLEAN NOT NULL DEFAULT true,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    max_attempts    INT NOT NULL DEFAULT 5
                    CONSTRAINT triggers_max_attempts_check CHECK (max_attempts BETWEEN 1 AND 1000),
    backoff_base_ms BIGINT NOT NULL DEFAULT 1000
                    CONSTRAINT triggers_backoff_base_check CHECK (backoff_base_ms BETWEEN 1 AND 86400000),
    backoff_cap_ms  BIGINT NOT NULL DEFAULT 600000
                    CONSTRAINT triggers_backoff_cap_check CHECK (backoff_cap_ms BETWEEN backoff_base_ms AND 86400000),
    UNIQUE (id, app_id),
    FOREIGN KEY (principal_id, app_id) REFERENCES principals (id, app_id)
);

-- The outbox holds deliveries that a trigger owes, with the same claim
-- columns as queue_messages.
CREATE TABLE outbox (
    id            UUID PRIMARY KEY DEFAULT gen_random_uuid(),
    app_id        UUID NOT NULL REFERENCES apps(id) ON DELETE CASCADE,
    source_kind   TEXT NOT NULL
                  CONSTRAINT outbox_source_kind_check CHECK (source_kind IN ('event', 'cron')),
    trigger_id    UUID NOT NULL,
    payload       JSONB NOT NULL,
    enqueued_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    deliver_after TIMESTAMPTZ NULL,
    claim_token   UUID NULL,
    claimed_at    TIMESTAMPTZ NULL,
    attempt       INT NOT NULL DEFAULT 0,
    max_attempts  INT NOT NULL DEFAULT 3,
    FOREIGN KEY (trigger_id, app_id) REFERENCES triggers (id, app_id) ON DELETE CASCADE
);

CREATE INDEX idx_outbox_dispatch ON outbox (trigger_id, enqueued_at) WHERE claim_token IS NULL;
CREATE INDEX idx_outbox_claimed ON outbox (claimed_at) WHERE claim_token IS NOT NULL;
