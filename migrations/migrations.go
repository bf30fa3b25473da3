// Package migrations holds Bellhop's schema as numbered SQL files and
// applies them with github.com/jackc/tern/v2/migrate.
//
// The files keep the numbers they were written with (0001 is the base that
// the seed assumed, 0034 is the seed itself, word for word). tern wants a
// gap-free sequence, so the files are appended to the migrator in number
// order and tern's version counts how many of them have been applied.
// Because that count is all a database records, a released file is never
// edited, renamed or preceded by a new number: released.sha256 pins each
// one, and a test fails on any such change. Schema changes go in a new
// file, with its line added to released.sha256.
//
// Indexes are built with a plain CREATE INDEX, inside the file's
// transaction, which holds off writes to the table while it builds (the
// outbox and the message tables are meant to stay short). CREATE INDEX
// CONCURRENTLY would deadlock with a second process migrating at the same
// time: it waits for every transaction with an older snapshot to end,
// and the other process's statement waiting for tern's advisory lock is
// one of them (golang-migrate/migrate#960 and coder/coder#8353 report the
// deadlock).
package migrations

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/tern/v2/migrate"
)

//go:embed *.sql
var files embed.FS

// VersionTable is the table in which tern records how many migrations have
// been applied.
const VersionTable = "public.bellhop_schema_version"

// File is one migration file.
type File struct {
	Number int
	Name   string
	SQL    string
}

// Files returns the embedded migration files in number order. It fails if
// two files share a number or a file name does not start with a number.
func Files() ([]File, error) {
	entries, err := fs.ReadDir(files, ".")
	if err != nil {
		return nil, fmt.Errorf("read embedded migrations: %w", err)
	}
	out := make([]File, 0, len(entries))
	seen := map[int]string{}
	for _, e := range entries {
		name := e.Name()
		prefix, _, ok := strings.Cut(name, "_")
		n, err := strconv.Atoi(prefix)
		if !ok || err != nil || n <= 0 {
			return nil, fmt.Errorf("migration %q: name must start with a positive number and an underscore", name)
		}
		if other, dup := seen[n]; dup {
			return nil, fmt.Errorf("migrations %q and %q share number %d", other, name, n)
		}
		seen[n] = name
		body, err := files.ReadFile(name)
		if err != nil {
			return nil, fmt.Errorf("read migration %q: %w", name, err)
		}
		out = append(out, File{Number: n, Name: name, SQL: string(body)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Number < out[j].Number })
	return out, nil
}

// Migrate applies every migration that conn's database lacks. It is
// idempotent, and safe to run from several processes at once: tern holds a
// session advisory lock while it migrates, and each file runs in its own
// transaction together with the version bump.
//
// It refuses to start the schema in a database whose encoding is not
// UTF8, with nothing applied (checkEncoding says why).
//
// A database whose schema is newer than this code's migrations (this code
// was rolled back after a newer version migrated it) is left as it is, and
// Migrate returns nil: migrations only add, so older code runs on the newer
// schema, as Check accepts it. Current tells such a database apart.
//
// Everything is created in schema public, whatever conn's search_path:
// each migration runs with search_path set to public (and pg_temp).
// Without that, a role that has a schema of its own name (PostgreSQL 15's
// secure schema usage pattern, with "$user" first on the search_path)
// would get the tables in its own schema, where the SECURITY DEFINER
// functions, whose search_path is pinned to public, do not look: migration
// 0044 failed halfway. tern resets the session's settings after each
// migration (RESET ALL), so afterwards conn's search_path is its session
// default, not what it was set to before Migrate.
//
// Each lock a migration waits for is waited for LockWait at most: a lock
// request queued behind a long transaction (a report, an idle session in
// a transaction) makes every producer and dispatcher that touches the
// table queue behind the request in turn, for as long as that
// transaction lasts. The migration is then rolled back and tried again,
// pausing from 0.5 s doubling to 5 s, for LockPatience; after that Migrate
// fails, naming the file, with the files before it applied and it and
// those after not. Once granted, a lock is held until its file commits:
// the upgrade notes in README.md say which files take long.
//
// conn must be a session (not a PgBouncer transaction-mode connection),
// because the advisory lock is session-scoped.
func Migrate(ctx context.Context, conn *pgx.Conn, opts ...Option) error {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	return migrateWaiting(ctx, conn, LockWait, LockPatience, o.onLockWait)
}

// Option is an option of Migrate.
type Option func(*options)

type options struct {
	onLockWait func(file string, patience time.Duration)
}

// OnLockWait has Migrate call f when a migration first finds a lock it
// needs held (a long transaction holds its table): Migrate then tries it
// again for up to patience, saying nothing meanwhile. Once per file.
func OnLockWait(f func(file string, patience time.Duration)) Option {
	return func(o *options) { o.onLockWait = f }
}

// Bounds of Migrate's waits for the locks its migrations take.
const (
	// LockWait is the longest a migration waits for one lock
	// (lock_timeout) before it is rolled back and tried again.
	LockWait = 2 * time.Second
	// LockPatience is how long Migrate keeps trying a migration that
	// cannot get its locks.
	LockPatience = 2 * time.Minute
)

func migrateWaiting(ctx context.Context, conn *pgx.Conn, lockWait, patience time.Duration, onLockWait func(string, time.Duration)) error {
	latest, err := Latest()
	if err != nil {
		return err
	}
	// Read first, so that a newer schema is not touched at all (tern
	// refuses a version above its last migration).
	current, err := Current(ctx, conn)
	if err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	if current > latest {
		return nil
	}
	fs, err := Files()
	if err != nil {
		return err
	}
	if err := checkEncoding(conn, current, fs); err != nil {
		return err
	}
	if err := checkIndexes(ctx, conn, current, fs); err != nil {
		return err
	}
	m, err := migrate.NewMigrator(ctx, conn, VersionTable)
	if err != nil {
		return fmt.Errorf("migrate: prepare version table: %w", err)
	}
	for _, f := range fs {
		m.AppendMigration(f.Name, pinSearchPath(f.SQL, lockWait), "")
	}
	start := time.Now()
	pause := 500 * time.Millisecond
	var told string // the file onLockWait was last called for
	for tries := 1; ; tries++ {
		err := m.Migrate(ctx)
		if err == nil {
			return nil
		}
		// A newer version may have migrated the database since it was
		// read above: tern then refuses the version it finds.
		var bad migrate.BadVersionError
		if errors.As(err, &bad) {
			if v, cerr := Current(ctx, conn); cerr == nil && v > latest {
				return nil
			}
		}
		var mErr migrate.MigrationPgError
		if !errors.As(err, &mErr) || mErr.Code != "55P03" { // lock_not_available
			return fmt.Errorf("migrate: %w", err)
		}
		if onLockWait != nil && mErr.MigrationName != told {
			told = mErr.MigrationName
			onLockWait(told, patience)
		}
		if time.Since(start)+pause > patience {
			return fmt.Errorf("migrate: %s could not take a lock it needs within %s, %d tries over %s "+
				"(a long transaction holds its table: see pg_stat_activity); it and the files after it were not applied, "+
				"those before it were; run migrate again when the database is quieter: %w",
				mErr.MigrationName, lockWait, tries, time.Since(start).Round(time.Second), err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("migrate: %w (waiting to try %s again, for a lock it could not take: %w)", context.Cause(ctx), mErr.MigrationName, err)
		case <-time.After(pause):
		}
		pause = min(2*pause, 5*time.Second)
	}
}

// seedFile is the migration that creates queue_messages.
const seedFile = "0034_queue_messages.sql"

// checkEncoding refuses to install the schema in a database whose encoding
// is not UTF8. pgx sends UTF-8 without setting client_encoding, which then
// defaults to the database's encoding: in another encoding, PostgreSQL
// takes the bytes for that encoding's characters, so payloads, queue names
// and error texts are stored garbled for every client that reads them
// correctly; and in a multibyte encoding such as EUC_JP, UTF-8 that is not
// also a valid sequence of it ("—") fails its statement: the seed
// migration's comments, or a handler's error text, and with it the whole
// batch of outcomes written with it. SQL_ASCII stores bytes as they come,
// but cannot convert a jsonb \u escape above U+007F: a valid payload such
// as {"a":"\u00e9"} (Python's json.dumps writes it so by default, Go's
// json.Marshal for U+2028) fails every enqueue with SQLSTATE 0A000
// "conversion between UTF8 and SQL_ASCII is not supported", which names
// neither the payload nor the cause.
// A database already past the seed migration is left to run as it has.
func checkEncoding(conn *pgx.Conn, current int, fs []File) error {
	for i, f := range fs {
		if f.Name == seedFile && current > i {
			return nil
		}
	}
	switch enc := conn.PgConn().ParameterStatus("server_encoding"); enc {
	case "UTF8":
		return nil
	default:
		return fmt.Errorf("migrate: database %q has encoding %s; Bellhop needs UTF8 (CREATE DATABASE ... ENCODING 'UTF8' TEMPLATE template0): nothing was applied",
			conn.Config().Database, enc)
	}
}

// createIndex finds the names of the indexes a migration creates.
var createIndex = regexp.MustCompile(`(?i)\bCREATE\s+(?:UNIQUE\s+)?INDEX\s+(?:CONCURRENTLY\s+)?(?:IF\s+NOT\s+EXISTS\s+)?([a-z0-9_]+)`)

// InvalidIndex is an index that a migration creates, left invalid by a
// CREATE INDEX CONCURRENTLY (or REINDEX) that failed: it serves no query
// and costs every write.
type InvalidIndex struct {
	Name string // in schema public
	File string // the migration that creates it
	// Applied is whether File has run: if not, dropping the index lets it
	// build the index; if so, nothing will, and it must be built again.
	Applied bool
}

// Fix says what to run about it.
func (x InvalidIndex) Fix() string {
	if x.Applied {
		return fmt.Sprintf("drop it and build it again as %s defines it, each outside a transaction: DROP INDEX CONCURRENTLY public.%s; then CREATE INDEX CONCURRENTLY ...", x.File, x.Name)
	}
	return fmt.Sprintf("drop it, and migrate builds it: DROP INDEX CONCURRENTLY public.%s", x.Name)
}

// InvalidIndexes lists the indexes that Bellhop's migrations create and
// that are invalid, leaving out those a CREATE INDEX CONCURRENTLY is
// still building (which are invalid until it ends; a role that may not
// see other roles' progress sees them as failed).
func InvalidIndexes(ctx context.Context, q Queryer) ([]InvalidIndex, error) {
	fs, err := Files()
	if err != nil {
		return nil, err
	}
	current, err := Current(ctx, q)
	if err != nil {
		return nil, err
	}
	return invalidIndexes(ctx, q, current, fs)
}

func invalidIndexes(ctx context.Context, q Queryer, current int, fs []File) ([]InvalidIndex, error) {
	byName := map[string]InvalidIndex{}
	var names []string
	for i, f := range fs {
		for _, m := range createIndex.FindAllStringSubmatch(f.SQL, -1) {
			n := strings.ToLower(m[1])
			if _, ok := byName[n]; !ok {
				names = append(names, n)
				// Versions count the files applied, from 1.
				byName[n] = InvalidIndex{Name: n, File: f.Name, Applied: current > i}
			}
		}
	}
	var invalid []string
	err := q.QueryRow(ctx, `SELECT coalesce(array_agg(c.relname::text ORDER BY c.relname), '{}')
		FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid
		WHERE NOT i.indisvalid AND c.relnamespace = 'public'::regnamespace AND c.relname = ANY($1)
		  AND NOT EXISTS (SELECT 1 FROM pg_stat_progress_create_index AS p WHERE p.index_relid = i.indexrelid)`, names).Scan(&invalid)
	if err != nil {
		return nil, fmt.Errorf("look for invalid indexes: %w", err)
	}
	out := make([]InvalidIndex, len(invalid))
	for i, n := range invalid {
		out[i] = byName[n]
	}
	return out, nil
}

// checkIndexes refuses to migrate while an index that a migration still
// to run creates is invalid: the README's upgrade notes suggest building
// 0064's indexes with CREATE INDEX CONCURRENTLY beforehand, a build that
// fails leaves an invalid index under its name, and the migration's IF
// NOT EXISTS would keep it, silently: claims would read without it.
// Indexes of migrations already run are the CLI's warning
// (InvalidIndexes): nothing Migrate does mends them.
func checkIndexes(ctx context.Context, conn *pgx.Conn, current int, fs []File) error {
	invalid, err := invalidIndexes(ctx, conn, current, fs)
	if err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	var names, fixes []string
	for _, x := range invalid {
		if !x.Applied {
			names = append(names, x.Name)
			fixes = append(fixes, x.Fix())
		}
	}
	if len(names) == 0 {
		return nil
	}
	return fmt.Errorf("migrate: index %s is invalid, as a CREATE INDEX CONCURRENTLY that failed leaves one, and the migrations would keep it as it is; "+
		"%s; then run migrate again: nothing was applied", strings.Join(names, ", "), strings.Join(fixes, "; "))
}

// pinSearchPath puts a SET of search_path to public (and pg_temp) before a
// migration's SQL: see Migrate; and, for a file that runs in a
// transaction, one of lock_timeout to lockWait. It is a session SET, not
// SET LOCAL, so that the search_path also holds in a migration that tern
// runs outside a transaction; tern resets the session's settings after
// each migration, in its transaction. A file outside a transaction keeps
// the server's lock_timeout: CREATE INDEX CONCURRENTLY cut short by it
// leaves an invalid index, which IF NOT EXISTS would then keep. The SETs
// go on the file's first line, so that the line numbers of the file's
// statements are unchanged, unless that line is tern's marker for running
// the file outside a transaction, which must stay a line of its own.
func pinSearchPath(sql string, lockWait time.Duration) string {
	const set = "SET search_path = public, pg_temp; "
	if first, rest, ok := strings.Cut(sql, "\n"); ok && strings.TrimSpace(first) == "---- tern: disable-tx ----" {
		return first + "\n" + set + rest
	}
	return fmt.Sprintf("%sSET lock_timeout = %d; %s", set, lockWait.Milliseconds(), sql)
}

// Latest is the schema version that Migrate brings a database to.
func Latest() (int, error) {
	fs, err := Files()
	return len(fs), err
}

// Name is the file name of the migration that schema version v applied
// last (versions count the files applied, in number order), or "none" for
// version 0 and "unknown" for a version above Latest.
func Name(v int) string {
	fs, err := Files()
	switch {
	case err != nil || v > len(fs):
		return "unknown"
	case v <= 0:
		return "none"
	}
	return fs[v-1].Name
}

// Queryer is what Current and Check read the version with: a *pgx.Conn, a
// *pgxpool.Pool or a pgx.Tx.
type Queryer = interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Current returns the schema version of q's database: how many migrations
// have been applied, 0 if none (no version table). It may be above Latest,
// when a newer version of this code migrated the database.
func Current(ctx context.Context, q Queryer) (int, error) {
	// to_regclass needs no privilege on the table, and does not fail: a
	// missing table does not abort the caller's transaction.
	var exists bool
	if err := q.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", VersionTable).Scan(&exists); err != nil {
		return 0, fmt.Errorf("read the schema version: %w", err)
	}
	if !exists {
		return 0, nil
	}
	var v int32
	err := q.QueryRow(ctx, "SELECT version FROM "+VersionTable).Scan(&v)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return 0, nil
	case err != nil:
		return 0, fmt.Errorf("read the schema version: %w", err)
	}
	return int(v), nil
}

// PublicSchemaOpen reports whether every role may create objects in schema
// public, where Bellhop's objects live: PostgreSQL's default before
// version 15. A function or operator that one of them creates there, with
// the name of a built-in that Bellhop's SQL calls and a closer match for
// its arguments, then runs as whichever role runs that SQL: the owner, in
// Bellhop's SECURITY DEFINER functions. `REVOKE CREATE ON SCHEMA public
// FROM PUBLIC` closes it. user is the session's role, which may itself
// create there only through PUBLIC's grant: it needs one of its own first,
// or the next migration that adds an object fails.
func PublicSchemaOpen(ctx context.Context, q Queryer) (open bool, user string, err error) {
	if err := q.QueryRow(ctx, "SELECT has_schema_privilege('public', 'public', 'CREATE'), current_user").Scan(&open, &user); err != nil {
		return false, "", fmt.Errorf("read the privileges on schema public: %w", err)
	}
	return open, user, nil
}

// PublicCreators are the roles that may create objects in schema public
// besides the session's role (PublicSchemaCreators).
type PublicCreators struct {
	// Owners own the schema or are members of its owner (from
	// PostgreSQL 15 on the owner is pg_database_owner, so the database's
	// owner is one): no REVOKE reaches them. The schema must be given to
	// another role (ALTER SCHEMA public OWNER TO), or Bellhop migrated as
	// its owner.
	Owners []string
	// Granted may create by a grant, their own or one of a role they are
	// members of.
	Granted []string
	// Grantees hold the grants that Granted create by, those a REVOKE
	// takes back: not the session's role, nor a role it is a member of,
	// whose grant Bellhop's next migration needs.
	Grantees []string
}

// PublicSchemaCreators returns the roles that may create objects in
// schema public although PUBLIC may not (PublicSchemaOpen), leaving out
// the session's role, the roles that may act as it anyway (its members)
// and superusers. Each can plant there a function named like a built-in
// that Bellhop's SQL calls, with a closer match for its arguments, and so
// run code as the session's role (Bellhop's owner, in its SECURITY
// DEFINER functions): such a role is as trusted as the owner. Predefined
// roles (pg_*) are left out: their members are listed themselves.
func PublicSchemaCreators(ctx context.Context, q Queryer) (PublicCreators, error) {
	var c PublicCreators
	err := q.QueryRow(ctx, `WITH public_schema AS (
		    SELECT nspowner, nspacl FROM pg_namespace WHERE nspname = 'public'
		), creators AS (
		    SELECT r.rolname::text AS name, pg_has_role(r.oid, s.nspowner, 'MEMBER') AS owner
		    FROM pg_roles AS r, public_schema AS s
		    WHERE has_schema_privilege(r.oid, 'public', 'CREATE')
		      AND NOT r.rolsuper
		      AND NOT pg_has_role(r.oid, current_user, 'MEMBER')
		      AND r.rolname NOT LIKE 'pg\_%'
		)
		SELECT coalesce((SELECT array_agg(name ORDER BY name) FROM creators WHERE owner), '{}'),
		       coalesce((SELECT array_agg(name ORDER BY name) FROM creators WHERE NOT owner), '{}'),
		       coalesce((SELECT array_agg(DISTINCT r.rolname::text ORDER BY r.rolname::text)
		                 FROM public_schema AS s, aclexplode(s.nspacl) AS a
		                 JOIN pg_roles AS r ON r.oid = a.grantee
		                 WHERE a.privilege_type = 'CREATE'
		                   AND r.oid <> s.nspowner
		                   AND NOT r.rolsuper
		                   AND r.rolname <> current_user
		                   -- a superuser counts as a member of every role,
		                   -- and needs no grant of its own
		                   AND ((SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
		                        OR NOT pg_has_role(current_user, r.oid, 'MEMBER'))), '{}')`).
		Scan(&c.Owners, &c.Granted, &c.Grantees)
	if err != nil {
		return PublicCreators{}, fmt.Errorf("read the roles that may create in schema public: %w", err)
	}
	return c, nil
}

// ErrNoSchema is Check's error for a database that Bellhop's migrations
// have never been applied to.
var ErrNoSchema = errors.New("database has no Bellhop schema: run `bellhop migrate`")

// ErrSchemaBehind is wrapped by Check's error for a database whose schema
// is older than this code's migrations.
var ErrSchemaBehind = errors.New("database schema is behind this code's migrations")

// behindError is Check's error for an old schema: it says which versions,
// and errors.Is finds ErrSchemaBehind in it.
type behindError struct{ current, latest int }

func (e *behindError) Error() string {
	return fmt.Sprintf("database schema at version %d, this code needs %d: run `bellhop migrate`", e.current, e.latest)
}

func (e *behindError) Unwrap() error { return ErrSchemaBehind }

// Check returns nil if q's database has this code's schema: version Latest,
// or a newer one (migrations only add, and are applied before a rolling
// upgrade of the code). Otherwise it returns ErrNoSchema, or an error that
// wraps ErrSchemaBehind and names both versions; or the error of reading
// the version (e.g. a role without SELECT on the version table, which
// docs/roles.sql grants).
func Check(ctx context.Context, q interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}) error {
	latest, err := Latest()
	if err != nil {
		return err
	}
	current, err := Current(ctx, q)
	switch {
	case err != nil:
		return err
	case current == 0:
		return ErrNoSchema
	case current < latest:
		return &behindError{current: current, latest: latest}
	}
	return nil
}
