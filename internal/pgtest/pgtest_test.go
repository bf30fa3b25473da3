package pgtest

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/bellhopq/bellhop/internal/pgdsn"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

func TestMain(m *testing.M) { Main(m) }

func connect(t *testing.T, dsn string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), dsn)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

func databaseExists(t *testing.T, name string) bool {
	t.Helper()
	conn := connect(t, AdminConnString())
	var exists bool
	if err := conn.QueryRow(t.Context(), "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", name).Scan(&exists); err != nil {
		t.Fatal(err)
	}
	return exists
}

// migratedName returns the name of conn's database, failing t unless it
// is migrated.
func migratedName(t *testing.T, conn *pgx.Conn) string {
	t.Helper()
	var db string
	var hasTable bool
	if err := conn.QueryRow(t.Context(),
		"SELECT current_database(), to_regclass('public.queue_messages') IS NOT NULL").Scan(&db, &hasTable); err != nil {
		t.Fatal(err)
	}
	if !hasTable {
		t.Fatalf("database %s lacks queue_messages", db)
	}
	return db
}

func TestParallelTestsGetDistinctMigratedDatabases(t *testing.T) {
	var mu sync.Mutex
	names := map[string]string{}
	t.Run("group", func(t *testing.T) {
		for _, sub := range []string{"a", "b"} {
			t.Run(sub, func(t *testing.T) {
				t.Parallel()
				t0 := time.Now()
				dsn := ConnString(t)
				t.Logf("ConnString: %v", time.Since(t0))
				conn := connect(t, dsn)
				db := migratedName(t, conn)
				if !strings.HasPrefix(db, "bellhop_t_") {
					t.Fatalf("database name %q", db)
				}
				// Writes stay in this test's database.
				if _, err := conn.Exec(t.Context(), "CREATE TABLE only_in_"+sub+" ()"); err != nil {
					t.Fatal(err)
				}
				mu.Lock()
				names[sub] = db
				mu.Unlock()
			})
		}
	})
	if t.Failed() {
		return
	}
	if names["a"] == names["b"] {
		t.Fatalf("both parallel tests got database %s", names["a"])
	}
	for _, db := range names {
		if databaseExists(t, db) {
			t.Errorf("database %s not dropped after its test", db)
		}
	}
}

// TestDatabase: Database, for code without a testing.TB, gives a migrated
// database of its own, which stays until Main drops it with the others,
// even with a connection left open.
func TestDatabase(t *testing.T) {
	dsn, err := Database()
	if err != nil {
		t.Fatal(err)
	}
	other, err := Database()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, d := range []string{dsn, other} {
		names = append(names, migratedName(t, connect(t, d)))
	}
	if names[0] == names[1] {
		t.Fatalf("two calls got database %s", names[0])
	}
	for _, db := range names {
		if !databaseExists(t, db) {
			t.Fatalf("database %s dropped before Main's end", db)
		}
	}
	// What Main does after the run, with both connections still open.
	if err := dropUntracked(); err != nil {
		t.Fatal(err)
	}
	for _, db := range names {
		if databaseExists(t, db) {
			t.Errorf("database %s not dropped", db)
		}
	}
}

func TestNewPool(t *testing.T) {
	pool := NewPool(t)
	if got := pool.Config().MaxConns; got != poolMaxConns {
		t.Fatalf("MaxConns = %d, want %d", got, poolMaxConns)
	}
	var n int
	if err := pool.QueryRow(t.Context(), "SELECT count(*) FROM queue_messages").Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("fresh database has %d queue messages", n)
	}
	// A test that leaves connections open must still get its database dropped.
	conn, err := pool.Acquire(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(conn.Release)
}

func TestTemplateIsCompleteAndReused(t *testing.T) {
	conn := connect(t, AdminConnString())
	var isTemplate, allowConn bool
	if err := conn.QueryRow(t.Context(), "SELECT datistemplate, datallowconn FROM pg_database WHERE datname = $1",
		template).Scan(&isTemplate, &allowConn); err != nil {
		t.Fatalf("template %s: %v", template, err)
	}
	if !isTemplate || allowConn {
		t.Fatalf("template %s: datistemplate=%v datallowconn=%v", template, isTemplate, allowConn)
	}
	t0 := time.Now()
	if err := ensureTemplate(t.Context(), AdminConnString(), template); err != nil {
		t.Fatal(err)
	}
	t.Logf("ensureTemplate on an existing template: %v", time.Since(t0))
}

// TestTemplateBuildRacesAndRecovery builds a separate template from several
// goroutines at once (as parallel test binaries would), then checks that a
// half-built template, as left by a killed binary, is rebuilt.
func TestTemplateBuildRacesAndRecovery(t *testing.T) {
	name := "bellhop_tmpl_test_" + randomHex(4)
	admin := connect(t, AdminConnString())
	t.Cleanup(func() {
		ctx := context.Background()
		_, _ = admin.Exec(ctx, "ALTER DATABASE "+ident(name)+" IS_TEMPLATE false")
		_, _ = admin.Exec(ctx, "DROP DATABASE IF EXISTS "+ident(name)+" WITH (FORCE)")
	})

	t0 := time.Now()
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i := range errs {
		wg.Go(func() { errs[i] = ensureTemplate(t.Context(), AdminConnString(), name) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	t.Logf("3 concurrent ensureTemplate calls: %v", time.Since(t0))

	// Make it look half-built: not marked complete, and missing a table.
	if _, err := admin.Exec(t.Context(), "ALTER DATABASE "+ident(name)+" IS_TEMPLATE false ALLOW_CONNECTIONS true"); err != nil {
		t.Fatal(err)
	}
	dsn, err := pgdsn.WithDatabase(AdminConnString(), name)
	if err != nil {
		t.Fatal(err)
	}
	func() {
		c := connect(t, dsn)
		defer c.Close(t.Context())
		if _, err := c.Exec(t.Context(), "DROP TABLE queue_messages CASCADE"); err != nil {
			t.Fatal(err)
		}
	}()
	if err := ensureTemplate(t.Context(), AdminConnString(), name); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(t.Context(), "ALTER DATABASE "+ident(name)+" ALLOW_CONNECTIONS true"); err != nil {
		t.Fatal(err)
	}
	c := connect(t, dsn)
	var hasTable bool
	if err := c.QueryRow(t.Context(), "SELECT to_regclass('public.queue_messages') IS NOT NULL").Scan(&hasTable); err != nil {
		t.Fatal(err)
	}
	c.Close(t.Context())
	if !hasTable {
		t.Fatal("half-built template was reused instead of rebuilt")
	}
}

func TestDatabaseURL(t *testing.T) {
	if os.Getenv("PGTEST_CHILD") != "" {
		return // inside a child process
	}
	// A non-default database in the URL checks that the admin DSN is
	// rewritten to "postgres".
	url, err := pgdsn.WithDatabase(AdminConnString(), "template1")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			cmd := exec.Command(os.Args[0], "-test.run=^TestChildUsesDatabaseURL$", "-test.count=1", "-test.v")
			cmd.Env = append(os.Environ(), "DATABASE_URL="+url, "PGTEST_CHILD=1")
			out, err := cmd.CombinedOutput()
			if err != nil || !bytes.Contains(out, []byte("--- PASS: TestChildUsesDatabaseURL")) {
				t.Errorf("child with DATABASE_URL: %v\n%s", err, out)
			}
		})
	}
	wg.Wait()
}

func TestChildUsesDatabaseURL(t *testing.T) {
	if os.Getenv("PGTEST_CHILD") == "" {
		return // a helper process of TestDatabaseURL, not a test of its own
	}
	if Cluster() != nil {
		t.Fatal("started a cluster although DATABASE_URL is set")
	}
	cfg, err := pgconn.ParseConfig(AdminConnString())
	if err != nil || cfg.Database != "postgres" {
		t.Fatalf("AdminConnString() = %q (%v)", AdminConnString(), err)
	}
	var hasTable bool
	if err := NewPool(t).QueryRow(t.Context(), "SELECT to_regclass('public.queue_messages') IS NOT NULL").Scan(&hasTable); err != nil {
		t.Fatal(err)
	}
	if !hasTable {
		t.Fatal("no queue_messages")
	}
}

// TestNoServerFails checks that an unreachable server fails the binary with
// instructions instead of skipping the tests.
func TestNoServerFails(t *testing.T) {
	if os.Getenv("PGTEST_CHILD") != "" {
		return // inside a child process
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestChildUsesDatabaseURL$", "-test.count=1")
	cmd.Env = append(os.Environ(), "DATABASE_URL=host=/nonexistent-bellhop port=1 user=postgres connect_timeout=5", "PGTEST_CHILD=1")
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Fatalf("child without a server: err %v, want exit status 1\n%s", err, out)
	}
	for _, want := range []string{"set DATABASE_URL", "apt-get install postgresql-15", "/nonexistent-bellhop"} {
		if !bytes.Contains(out, []byte(want)) {
			t.Errorf("child output lacks %q:\n%s", want, out)
		}
	}
}
