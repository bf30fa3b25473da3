// Package pgtest gives each test its own migrated PostgreSQL database.
//
// A test binary gets one server: DATABASE_URL when set, otherwise a
// throwaway cluster (internal/pgcluster) started in Main. The migrations
// are applied once, into a template database named after their hash, and
// every ConnString clones that template. A database per test (rather than
// a schema or a rolled-back transaction) is what isolates LISTEN/NOTIFY,
// whose channels are per database, and makes t.Parallel safe.
//
// Without a server the tests fail rather than skip: a green run that
// tested nothing would hide that the queue was never exercised.
package pgtest

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop/internal/pgcluster"
	"github.com/bellhopq/bellhop/internal/pgdsn"
	"github.com/bellhopq/bellhop/migrations"
)

// howToProvide is printed when no server is available.
const howToProvide = "pgtest: these tests need PostgreSQL: set DATABASE_URL to a server where this user may " +
	"CREATE DATABASE, or install PostgreSQL server binaries, e.g. apt-get install postgresql-15"

// templateLockKey serialises template creation across test binaries sharing
// one DATABASE_URL server (go test runs packages in parallel). Any fixed
// value works; this is "bellhop" in ASCII.
const templateLockKey int64 = 0x62656c6c686f70

const (
	poolMaxConns = 8
	// opTimeout bounds each administrative step so a frozen server (chaos
	// tests) fails a test instead of hanging the binary.
	opTimeout = 60 * time.Second
)

// Set once by Main, before any test runs, and read-only afterwards.
var (
	cluster  *pgcluster.Cluster
	adminDSN string
	template string
)

// untracked holds the databases that Database made, which Main drops
// once every test and example has run.
var untracked struct {
	sync.Mutex
	names []string
}

// errMigrations marks setup failures caused by the migrations themselves
// rather than by the server.
var errMigrations = errors.New("migrations failed")

// cloneMu serialises CREATE DATABASE ... TEMPLATE within the process: the
// clones only conflict with connections to the template, but running them
// one at a time keeps the server (2 cores in CI) responsive.
var cloneMu sync.Mutex

// Main runs the package's tests against a PostgreSQL server. Call it from
// TestMain. It exits the process with status 1 (failing the package) when no
// server can be had.
func Main(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	ctx, cancel := context.WithTimeout(context.Background(), 2*opTimeout)
	err := setup(ctx)
	cancel()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		if !errors.Is(err, errMigrations) { // a broken migration needs no install hint
			fmt.Fprintln(os.Stderr, howToProvide)
		}
		if cluster != nil {
			_ = cluster.Stop()
		}
		return 1
	}
	code := m.Run()
	if err := dropUntracked(); err != nil {
		fmt.Fprintf(os.Stderr, "pgtest: %v\n", err)
		if code == 0 {
			code = 1
		}
	}
	if cluster != nil {
		if err := cluster.Stop(); err != nil {
			fmt.Fprintf(os.Stderr, "pgtest: %v\n", err)
			if code == 0 {
				code = 1
			}
		}
	}
	return code
}

func setup(ctx context.Context) error {
	if url := os.Getenv("DATABASE_URL"); url != "" {
		dsn, err := pgdsn.WithDatabase(url, "postgres")
		if err != nil {
			return fmt.Errorf("pgtest: DATABASE_URL: %w", err)
		}
		adminDSN = dsn
	} else {
		c, err := pgcluster.Start(ctx, pgcluster.Options{Settings: map[string]string{
			// Durability is irrelevant for throwaway test data, and
			// turning it off makes CREATE DATABASE and commits cheap.
			"fsync":              "off",
			"synchronous_commit": "off",
			"full_page_writes":   "off",
		}})
		if err != nil {
			return fmt.Errorf("pgtest: start a throwaway PostgreSQL (DATABASE_URL is not set): %w", err)
		}
		cluster = c
		adminDSN = c.ConnString("postgres")
	}
	name, err := templateName()
	if err != nil {
		return fmt.Errorf("pgtest: %w", err)
	}
	if err := ensureTemplate(ctx, adminDSN, name); err != nil {
		if cluster == nil {
			return fmt.Errorf("pgtest: server from DATABASE_URL: %w", err)
		}
		return fmt.Errorf("pgtest: throwaway cluster in %s: %w", cluster.Dir(), err)
	}
	template = name
	return nil
}

// Cluster returns the throwaway cluster the tests run against, e.g. to
// restart or freeze it, or nil when DATABASE_URL is in use.
func Cluster() *pgcluster.Cluster { return cluster }

// AdminConnString returns the DSN of the maintenance database ("postgres")
// on the server in use.
func AdminConnString() string { return adminDSN }

// templateName names the template after the migrations' content, so a
// changed migration gets a fresh template instead of a stale one, and
// unchanged migrations reuse the template across runs on DATABASE_URL.
func templateName() (string, error) {
	files, err := migrations.Files()
	if err != nil {
		return "", err
	}
	h := sha256.New()
	for _, f := range files {
		// Names count too: tern applies files in order.
		fmt.Fprintf(h, "%s\x00%s\x00", f.Name, f.SQL)
	}
	return "bellhop_tmpl_" + hex.EncodeToString(h.Sum(nil))[:12], nil
}

// ensureTemplate creates and migrates the template database unless a
// complete one exists. Completion is marked by datistemplate, set only
// after the migrations succeeded, so a half-built template left by a killed
// binary is rebuilt rather than cloned.
func ensureTemplate(ctx context.Context, adminDSN, name string) error {
	admin, err := pgx.Connect(ctx, adminDSN)
	if err != nil {
		return fmt.Errorf("connect to the maintenance database: %w", err)
	}
	defer admin.Close(context.Background())
	// Session lock: released on disconnect too, so a crashed builder never
	// blocks the others for good.
	if _, err := admin.Exec(ctx, "SELECT pg_advisory_lock($1)", templateLockKey); err != nil {
		return fmt.Errorf("lock template creation: %w", err)
	}
	defer admin.Exec(context.Background(), "SELECT pg_advisory_unlock($1)", templateLockKey)

	var complete bool
	err = admin.QueryRow(ctx, "SELECT datistemplate FROM pg_database WHERE datname = $1", name).Scan(&complete)
	switch {
	case err == nil && complete:
		return nil
	case err == nil:
		if _, err := admin.Exec(ctx, "DROP DATABASE "+ident(name)+" WITH (FORCE)"); err != nil {
			return fmt.Errorf("drop incomplete template %s: %w", name, err)
		}
	case !errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("look up template %s: %w", name, err)
	}

	if _, err := admin.Exec(ctx, "CREATE DATABASE "+ident(name)); err != nil {
		return fmt.Errorf("create template %s: %w", name, err)
	}
	if err := migrate(ctx, adminDSN, name); err != nil {
		return err
	}
	// IS_TEMPLATE lets users with only CREATEDB clone it; ALLOW_CONNECTIONS
	// false keeps stray sessions (and routine autovacuum) out of it, since
	// any session connected to it makes CREATE DATABASE ... TEMPLATE fail.
	if _, err := admin.Exec(ctx, "ALTER DATABASE "+ident(name)+" WITH IS_TEMPLATE true ALLOW_CONNECTIONS false"); err != nil {
		return fmt.Errorf("mark template %s complete: %w", name, err)
	}
	return nil
}

func migrate(ctx context.Context, adminDSN, dbname string) error {
	dsn, err := pgdsn.WithDatabase(adminDSN, dbname)
	if err != nil {
		return err
	}
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return fmt.Errorf("connect to template %s: %w", dbname, err)
	}
	// Closed before anyone clones: a connected session blocks cloning.
	defer conn.Close(context.Background())
	if err := migrations.Migrate(ctx, conn); err != nil {
		return fmt.Errorf("%w: template %s: %w", errMigrations, dbname, err)
	}
	return nil
}

// ConnString creates a new database for t, cloned from the migrated
// template, and returns its DSN. The database is dropped (with FORCE, so
// leftover connections do not block it) when t finishes.
func ConnString(t testing.TB) string {
	t.Helper()
	name, dsn, err := newDatabase()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := dropDatabase(name); err != nil {
			t.Errorf("pgtest: drop test database %s: %v", name, err)
		}
	})
	return dsn
}

// Database is ConnString for code that has no testing.TB, such as an
// Example function: it creates a new database, cloned from the migrated
// template, and returns its DSN. Main drops it once every test and
// example has run.
func Database() (string, error) {
	name, dsn, err := newDatabase()
	if err != nil {
		return "", err
	}
	untracked.Lock()
	untracked.names = append(untracked.names, name)
	untracked.Unlock()
	return dsn, nil
}

// newDatabase clones the template into a database of a new name.
func newDatabase() (name, dsn string, err error) {
	if template == "" {
		return "", "", errors.New("pgtest: no server; call pgtest.Main(m) from TestMain")
	}
	name = "bellhop_t_" + randomHex(8)
	dsn, err = pgdsn.WithDatabase(adminDSN, name)
	if err != nil {
		return "", "", fmt.Errorf("pgtest: %w", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	if err := createFromTemplate(ctx, name); err != nil {
		return "", "", fmt.Errorf("pgtest: %w", err)
	}
	return name, dsn, nil
}

// dropDatabase drops name, with FORCE, so that leftover connections do
// not block it.
func dropDatabase(name string) error {
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	return adminExec(ctx, "DROP DATABASE IF EXISTS "+ident(name)+" WITH (FORCE)")
}

// dropUntracked drops the databases Database made.
func dropUntracked() error {
	untracked.Lock()
	defer untracked.Unlock()
	var errs []error
	for _, name := range untracked.names {
		if err := dropDatabase(name); err != nil {
			errs = append(errs, fmt.Errorf("drop database %s: %w", name, err))
		}
	}
	untracked.names = nil
	return errors.Join(errs...)
}

// createFromTemplate clones the template into name. SQLSTATE 55006 ("source
// database is being accessed by other users") is retried: it is transient
// (e.g. an anti-wraparound autovacuum, or another binary's builder that is
// just disconnecting).
func createFromTemplate(ctx context.Context, name string) error {
	cloneMu.Lock()
	defer cloneMu.Unlock()
	sql := "CREATE DATABASE " + ident(name) + " TEMPLATE " + ident(template)
	backoff := 20 * time.Millisecond
	for attempt := 1; ; attempt++ {
		err := adminExec(ctx, sql)
		var pgErr *pgconn.PgError
		if err == nil || !errors.As(err, &pgErr) || pgErr.Code != "55006" || attempt == 8 {
			if err != nil {
				return fmt.Errorf("create test database from %s: %w", template, err)
			}
			return nil
		}
		select {
		case <-time.After(backoff):
			backoff *= 2
		case <-ctx.Done():
			return fmt.Errorf("create test database from %s: %w (last: %v)", template, ctx.Err(), err)
		}
	}
}

// adminExec runs sql on a fresh maintenance connection. Not a long-lived
// connection: tests restart the server, which would break it.
func adminExec(ctx context.Context, sql string) error {
	conn, err := pgx.Connect(ctx, adminDSN)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, sql)
	return err
}

// NewPool returns a pool on a new database (see ConnString), closed when t
// finishes. It is kept small so that many parallel tests fit within the
// server's max_connections.
func NewPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(ConnString(t))
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	cfg.MaxConns = poolMaxConns
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("pgtest: new pool: %v", err)
	}
	// Registered after ConnString's drop, so it runs before it.
	t.Cleanup(pool.Close)
	if err := pool.Ping(ctx); err != nil {
		t.Fatalf("pgtest: ping new pool: %v", err)
	}
	return pool
}

func ident(name string) string { return pgx.Identifier{name}.Sanitize() }

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // crypto/rand.Read never fails on Linux
	return hex.EncodeToString(b)
}
