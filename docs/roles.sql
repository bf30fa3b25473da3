-- Least-privilege roles for Bellhop. Run it as the owner of Bellhop's
-- tables (the role that ran `bellhop migrate`), in Bellhop's database,
-- after migrating. It is idempotent. Run it again after every `bellhop
-- migrate`: it grants on the tables that exist when it runs, and new
-- migrations add tables the roles need (0047 added bellhop_vt_floors,
-- which the dispatcher's reclaim reads).
-- The roles are NOLOGIN groups: grant them to login roles, e.g.
--   CREATE ROLE orders_service LOGIN PASSWORD '...' IN ROLE bellhop_producer;
--   CREATE ROLE bellhop_daemon LOGIN PASSWORD '...' IN ROLE bellhop_dispatcher;
-- Migrations, app and consumer management keep to the owner role.
-- bellhop_producer may read no table, apps included: it cannot look its
-- app up by name (SELECT ... FROM apps, or the Go client's Enqueue, which
-- takes an app name). Give each producer its app's id (`bellhop app ls`)
-- and have it pass that id to INSERT or enqueue().

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'bellhop_producer') THEN
        CREATE ROLE bellhop_producer NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'bellhop_dispatcher') THEN
        CREATE ROLE bellhop_dispatcher NOLOGIN;
    END IF;
END
$$;

GRANT USAGE ON SCHEMA public TO bellhop_producer, bellhop_dispatcher;

-- Only trusted roles may create objects in schema public, where Bellhop's
-- are: a function or operator created there, with the name of a built-in
-- that Bellhop's SQL calls and a closer match for its arguments, runs as
-- whichever role runs that SQL: the dispatcher's and the producers' roles,
-- and the owner when it runs `bellhop migrate` or other commands. (Since
-- migration 0066 Bellhop's SECURITY DEFINER functions, enqueue() among
-- them, look up nothing in public but Bellhop's own names, so a producer's
-- call no longer runs such a function as the owner.) PostgreSQL 15 and
-- later grant PUBLIC no CREATE on it; before
-- 15 every role has it, and `bellhop migrate` warns while it does. The
-- owner of Bellhop's tables, which `bellhop migrate` runs as, gets a grant
-- of its own first, or the next migration that adds an object would fail.
-- Give roles of other applications a schema of their own, not CREATE on
-- public: any role that may create there, by a grant or as the schema's
-- owner (from PostgreSQL 15 on, the database's owner), can run code as
-- Bellhop's roles the same way, and `bellhop migrate` warns of each. Run
-- by a role that does not own the schema, this only warns that it granted
-- and revoked nothing.
DO $$
BEGIN
    EXECUTE format('GRANT CREATE ON SCHEMA public TO %I',
                   (SELECT tableowner FROM pg_tables WHERE schemaname = 'public' AND tablename = 'queue_messages'));
END
$$;
REVOKE CREATE ON SCHEMA public FROM PUBLIC;

-- Producers may add messages, with a plain INSERT (without RETURNING,
-- which would need SELECT) or with enqueue(), which returns the new id.
-- They cannot read, change or delete messages. A plain INSERT may set the
-- message's own columns only, not the dispatcher's (claim_token,
-- claimed_at, attempt): a message inserted already leased, or with
-- attempts used, would wait for a lease nobody holds, or die early. The
-- REVOKE takes back the whole-table grant of earlier versions of this
-- script. enqueued_by_principal is checked only by enqueue() (and the Go
-- client), which refuse a principal not of the message's app: a plain
-- INSERT may set it to any UUID, another app's principal or none that
-- exists, so it records what the producer declared, not who it is. Where
-- it must be trusted, grant producers EXECUTE on enqueue() and no INSERT.
REVOKE INSERT ON queue_messages FROM bellhop_producer;
GRANT INSERT (id, app_id, queue_name, payload, enqueued_at, deliver_after, max_attempts, enqueued_by_principal)
    ON queue_messages TO bellhop_producer;
GRANT EXECUTE ON FUNCTION enqueue(UUID, TEXT, JSONB, TIMESTAMPTZ, INT, UUID) TO bellhop_producer;

-- The dispatcher claims, settles and reclaims messages, reads consumers,
-- moves dead letters, and reads the queue list for its metrics.
GRANT SELECT, UPDATE, DELETE ON queue_messages, outbox TO bellhop_dispatcher;
GRANT SELECT, INSERT, UPDATE ON dead_letters TO bellhop_dispatcher;
GRANT SELECT ON apps, principals, triggers, queue_trigger_details, queue_consumers, queue_list TO bellhop_dispatcher;
-- `bellhop run` reads the schema version before it starts, and refuses a
-- database older than its migrations.
GRANT SELECT ON bellhop_schema_version TO bellhop_dispatcher;
GRANT UPDATE (last_fired_at) ON queue_trigger_details TO bellhop_dispatcher;
-- Busy marks (migrations/0041_busy_marks.sql): the rows other dispatchers
-- watch. The busy keys (0042) are advisory locks, which, like pg_notify
-- and pg_locks, every role may use: neither role needs a grant for them.
-- Nor can any role be refused them: advisory locks cannot be revoked.
-- Every role that can connect, Bellhop's or not, can hold a queue's busy
-- key (hashtextextended(app_id || ':' || queue_name, 1650814062); app ids
-- and queue names are learnt by LISTEN bellhop), and the queue's
-- producers then skip their notifications: its next message waits for a
-- dispatcher's fallback poll (up to PollInterval), and later ones up to
-- BusyLease (2 s), as the dispatchers watch the foreign key. Holding the
-- queue's lock (seed 1650814061) exclusively makes its producers wait.
-- Such a role can delay messages, not lose or read them. To prevent it,
-- let only Bellhop's login roles (and the owner) connect, e.g.
--   REVOKE CONNECT ON DATABASE bellhop FROM PUBLIC;
--   GRANT CONNECT ON DATABASE bellhop TO orders_service, bellhop_daemon;
-- (not done here: the database's name, and who else needs it, are yours).
GRANT SELECT, INSERT, UPDATE, DELETE ON queue_busy TO bellhop_dispatcher;
-- Offers (migrations/0044_lease_at_insert.sql): the dispatcher's poll
-- extends and deletes them, and a dispatcher with LeaseAtInsert makes
-- them. Producers need no grant: the notify trigger takes them through
-- bellhop_lease_message (0045), which is SECURITY DEFINER. Nobody else may
-- read them: an offer names the channel its lease, payload included, is
-- sent on. (Members of pg_read_all_stats, pg_monitor among them, read
-- statements' text in pg_stat_activity and pg_stat_statements: see
-- docs/lease-at-insert.md for what a leasing dispatcher keeps out of them,
-- and for, where pg_stat_statements is loaded,
--   ALTER ROLE bellhop_daemon SET pg_stat_statements.track_utility = off;
-- for its login role.) The lease key (0045) is an advisory lock: no grant
-- either.
GRANT SELECT, INSERT, UPDATE, DELETE ON bellhop_offers TO bellhop_dispatcher;
-- Visibility timeout floors (migrations/0047_vt_floor.sql): the reclaim
-- reads them, and starts those it sees (0054) through a SECURITY DEFINER
-- function every role may call; triggers write them through another.
GRANT SELECT ON bellhop_vt_floors TO bellhop_dispatcher;
