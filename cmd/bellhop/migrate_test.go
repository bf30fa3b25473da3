package main

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bellhopq/bellhop/internal/pgtest"
	"github.com/bellhopq/bellhop/migrations"
)

// TestMigrateNewerSchema: `bellhop migrate` on a database that a newer
// bellhop migrated (this one was rolled back) changes nothing, says so and
// exits 0, as `bellhop run` accepts such a schema. It used to fail with
// tern's "current version N is outside the valid versions".
func TestMigrateNewerSchema(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	latest, err := migrations.Latest()
	if err != nil {
		t.Fatal(err)
	}
	pool := db(t, dsn)
	if _, err := pool.Exec(context.Background(), "UPDATE "+migrations.VersionTable+" SET version = $1", latest+1); err != nil {
		t.Fatal(err)
	}
	before := schemaSnapshot(t, dsn)
	r := exe(t, dsn, "", "migrate")
	want := fmt.Sprintf("database schema is at version %d, newer than this bellhop's %d: nothing to apply\n", latest+1, latest)
	if r.code != 0 || r.stdout != want || r.stderr != "" {
		t.Fatalf("want exit 0 and %q; got %s", want, r)
	}
	if v := queryInt(t, pool, "SELECT version FROM "+migrations.VersionTable); v != latest+1 {
		t.Errorf("schema version %d after migrate, want %d", v, latest+1)
	}
	if after := schemaSnapshot(t, dsn); strings.Join(before, "\n") != strings.Join(after, "\n") {
		t.Errorf("migrate changed a newer schema:\nbefore %v\nafter  %v", before, after)
	}
}

// TestRunNewerSchema: `bellhop run` on a database that a newer bellhop
// migrated starts, gives the schema's version in its settings line and
// says, once, that the schema is newer than its own migrations; on its own
// schema it gives the version and says nothing of it.
func TestRunNewerSchema(t *testing.T) {
	t.Parallel()
	latest, err := migrations.Latest()
	if err != nil {
		t.Fatal(err)
	}
	newer := regexp.MustCompile(`"schema_version":` + strconv.Itoa(latest+1) + `,"binary_schema_version":` + strconv.Itoa(latest) +
		`,.*"message":"the database's schema is newer than this bellhop's migrations`)
	for _, bump := range []int{0, 1} {
		t.Run(fmt.Sprintf("version+%d", bump), func(t *testing.T) {
			t.Parallel()
			dsn := pgtest.ConnString(t)
			pool := db(t, dsn)
			if _, err := pool.Exec(context.Background(), "UPDATE "+migrations.VersionTable+" SET version = $1", latest+bump); err != nil {
				t.Fatal(err)
			}
			p := start(t, []string{"DATABASE_URL=" + dsn}, "run", "--http-addr", "127.0.0.1:0")
			p.waitLine(true, servingRE, 30*time.Second)
			p.signal(syscall.SIGTERM)
			if code := p.wait(30 * time.Second); code != 0 {
				t.Fatalf("exit %d:\n%s", code, p.stderr())
			}
			settings := regexp.MustCompile(`"schema_version":` + strconv.Itoa(latest+bump) + `,.*"message":"settings"`)
			if n := p.countErrLines(settings); n != 1 {
				t.Errorf("%d settings lines with schema_version %d, want 1:\n%s", n, latest+bump, p.stderr())
			}
			if n, want := p.countErrLines(newer), bump; n != want {
				t.Errorf("%d lines saying the schema is newer, want %d:\n%s", n, want, p.stderr())
			}
		})
	}
}

// TestMigrateWarnsOfOpenPublicSchema: where every role may create in
// schema public (PostgreSQL's default before 15), migrate says so, and
// how to close it, on stderr; it still migrates and exits 0. Where the
// schema is closed, it says nothing.
func TestMigrateWarnsOfOpenPublicSchema(t *testing.T) {
	t.Parallel()
	const warning = "bellhop: warning: every role may create objects in schema public"
	dsn := pgtest.ConnString(t)
	pool := db(t, dsn)
	// Closed, as from PostgreSQL 15 on.
	if _, err := pool.Exec(context.Background(), "REVOKE CREATE ON SCHEMA public FROM PUBLIC"); err != nil {
		t.Fatal(err)
	}
	if r := exe(t, dsn, "", "migrate"); r.code != 0 || strings.Contains(r.stderr, warning) {
		t.Fatalf("migrate with schema public closed: want exit 0 and no warning; got %s", r)
	}
	if _, err := pool.Exec(context.Background(), "GRANT CREATE ON SCHEMA public TO PUBLIC"); err != nil {
		t.Fatal(err)
	}
	r := exe(t, dsn, "", "migrate")
	if r.code != 0 || !strings.Contains(r.stderr, warning) || !strings.Contains(r.stderr, "REVOKE CREATE ON SCHEMA public FROM PUBLIC") ||
		!regexp.MustCompile(`GRANT CREATE ON SCHEMA public TO "[^"]+";`).MatchString(r.stderr) ||
		!strings.HasPrefix(r.stdout, "database is at schema version") {
		t.Fatalf("migrate with schema public open: want exit 0, the version and a warning; got %s", r)
	}
}

// TestMigrateWarnsOfPublicSchemaCreators: a role other than the one that
// migrates that may create objects in schema public while PUBLIC may not
// can run code as Bellhop's owner through a function planted there (found
// by the security review): migrate names it on stderr, with the advice
// that mends its case, and still exits 0. A role granted CREATE is told to
// be revoked, as are the members of a role granted it, whose grant is
// the one named (found by the docs review); once it is, migrate says
// nothing; the database's owner,
// which owns public from PostgreSQL 15 on through pg_database_owner and
// which no REVOKE reaches (found by the review of the first version), is
// told apart.
func TestMigrateWarnsOfPublicSchemaCreators(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn := pgtest.ConnString(t)
	pool := db(t, dsn)
	// Roles are the cluster's: names of this test's own.
	granted := fmt.Sprintf("bellhop_t_granted_%d", time.Now().UnixNano())
	member := fmt.Sprintf("bellhop_t_member_%d", time.Now().UnixNano())
	owner := fmt.Sprintf("bellhop_t_owner_%d", time.Now().UnixNano())
	var database, me string
	if err := pool.QueryRow(ctx, "SELECT current_database(), current_user").Scan(&database, &me); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		"REVOKE CREATE ON SCHEMA public FROM PUBLIC",
		"CREATE ROLE " + granted,
		"GRANT CREATE ON SCHEMA public TO " + granted,
		"CREATE ROLE " + member + " IN ROLE " + granted,
		"CREATE ROLE " + owner,
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(ctx, "REVOKE CREATE ON SCHEMA public FROM "+granted)
		_, _ = pool.Exec(ctx, "ALTER DATABASE "+pgx.Identifier{database}.Sanitize()+" OWNER TO "+pgx.Identifier{me}.Sanitize())
		for _, role := range []string{member, granted, owner} {
			if _, err := pool.Exec(ctx, "DROP ROLE "+role); err != nil {
				t.Errorf("drop role %s: %v", role, err)
			}
		}
	})
	// Both may create; the grant to take back is the one role's.
	grantWarning := `bellhop: warning: "` + granted + `", "` + member + `" may create objects in schema public, where Bellhop's are, by a grant `
	revoke := `REVOKE CREATE ON SCHEMA public FROM "` + granted + `"` + "\n"
	r := exe(t, dsn, "", "migrate")
	if r.code != 0 || !strings.Contains(r.stderr, grantWarning) || !strings.Contains(r.stderr, revoke) ||
		strings.Contains(r.stderr, "as its owner") || strings.Contains(r.stderr, "every role may create") ||
		!strings.HasPrefix(r.stdout, "database is at schema version") {
		t.Fatalf("migrate with %s granted CREATE on public: want exit 0, the version and one warning naming it; got %s", granted, r)
	}
	if _, err := pool.Exec(ctx, "REVOKE CREATE ON SCHEMA public FROM "+granted); err != nil {
		t.Fatal(err)
	}
	if r := exe(t, dsn, "", "migrate"); r.code != 0 || strings.Contains(r.stderr, "warning") {
		t.Fatalf("migrate with no other role granted CREATE on public: want exit 0 and no warning; got %s", r)
	}
	if _, err := pool.Exec(ctx, "ALTER DATABASE "+pgx.Identifier{database}.Sanitize()+" OWNER TO "+owner); err != nil {
		t.Fatal(err)
	}
	ownerWarning := `bellhop: warning: "` + owner + `" may create objects in schema public, where Bellhop's are, as its owner `
	r = exe(t, dsn, "", "migrate")
	if r.code != 0 || !strings.Contains(r.stderr, ownerWarning) || !strings.Contains(r.stderr, "ALTER SCHEMA public OWNER TO") ||
		strings.Contains(r.stderr, "REVOKE") {
		t.Fatalf("migrate on a database %s owns: want exit 0 and a warning naming it as the owner; got %s", owner, r)
	}
}

// TestMigrateWarnsOfInvalidIndex: an index of a migration already run
// that a failed build left invalid (no query uses it) is named on stderr,
// with how to build it again; migrate still exits 0, since nothing it
// could apply mends it.
func TestMigrateWarnsOfInvalidIndex(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	pool := db(t, dsn)
	if r := exe(t, dsn, "", "migrate"); r.code != 0 || strings.Contains(r.stderr, "invalid") {
		t.Fatalf("migrate with every index valid: want exit 0 and no warning; got %s", r)
	}
	if _, err := pool.Exec(context.Background(), `UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'idx_outbox_ready'::regclass`); err != nil {
		t.Fatal(err)
	}
	r := exe(t, dsn, "", "migrate")
	const want = "bellhop: warning: index idx_outbox_ready is invalid (a CREATE INDEX CONCURRENTLY or REINDEX of it failed), so no query uses it; " +
		"drop it and build it again as 0064_ready_indexes.sql defines it, each outside a transaction: DROP INDEX CONCURRENTLY public.idx_outbox_ready; then CREATE INDEX CONCURRENTLY ...\n"
	if r.code != 0 || !strings.Contains(r.stderr, want) || !strings.HasPrefix(r.stdout, "database is at schema version") {
		t.Fatalf("migrate with an invalid index: want exit 0, the version and %q; got %s", want, r)
	}
}

// TestMigrateInterrupted: `bellhop migrate` that waits for a lock says so;
// SIGINT to it then cancels its statement on the server: no backend is left queued for
// the ACCESS EXCLUSIVE lock on queue_messages (which would block every
// producer behind it), the command exits 1 saying it was interrupted, and
// a later migrate completes. The process used to die at once and leave
// its backend waiting.
func TestMigrateInterrupted(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dsn := pgtest.ConnString(t)
	latest, err := migrations.Latest()
	if err != nil {
		t.Fatal(err)
	}
	pool := db(t, dsn)
	// Back to before 0052, which drops and re-creates queue_messages'
	// notify trigger, taking an ACCESS EXCLUSIVE lock (it and the ones
	// after it can run again).
	files, err := migrations.Files()
	if err != nil {
		t.Fatal(err)
	}
	before := -1
	for i, f := range files {
		if f.Number == 52 {
			before = i
		}
	}
	if before < 0 {
		t.Fatal("no migration 0052")
	}
	if _, err := pool.Exec(ctx, "UPDATE "+migrations.VersionTable+" SET version = $1", before); err != nil {
		t.Fatal(err)
	}
	// A reader holds ACCESS SHARE on queue_messages until it ends.
	reader, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Rollback(context.Background())
	if _, err := reader.Exec(ctx, "SELECT count(*) FROM queue_messages"); err != nil {
		t.Fatal(err)
	}
	const waiting = `SELECT count(*) FROM pg_locks
		WHERE NOT granted AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
		  AND relation = 'queue_messages'::regclass`

	p := start(t, []string{"DATABASE_URL=" + dsn}, "migrate")
	waitFor(t, 30*time.Second, "migrate to wait for the lock on queue_messages", func() bool {
		return queryInt(t, pool, waiting) > 0
	})
	// Once its first wait has timed out (LockWait), it says that it waits,
	// and for how long it will try: it used to be silent for that long.
	p.waitLine(true, regexp.MustCompile(`^bellhop: 0052_busy_keys_64\.sql is waiting for a lock that another transaction holds \(see pg_stat_activity\); trying again for up to 2m0s$`), 30*time.Second)
	p.signal(os.Interrupt)
	if code := p.wait(15 * time.Second); code != 1 {
		t.Errorf("migrate exited %d after SIGINT, want 1", code)
	}
	if !regexp.MustCompile(`(?m)^bellhop: interrupted: .*rolled back`).MatchString(p.stderr()) {
		t.Errorf("migrate's stderr does not say it was interrupted:\n%s", p.stderr())
	}
	// While the reader still holds its lock, nobody waits behind it.
	waitFor(t, 5*time.Second, "no backend to wait for a lock on queue_messages", func() bool {
		return queryInt(t, pool, waiting) == 0
	})
	if v := queryInt(t, pool, "SELECT version FROM "+migrations.VersionTable); v != before {
		t.Errorf("schema version %d after the interrupted migrate, want %d", v, before)
	}
	if err := reader.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if out := ok(t, dsn, "migrate"); out != fmt.Sprintf("database is at schema version %d (%s)\n", latest, migrations.Name(latest)) {
		t.Errorf("migrate after the interrupted one printed %q", out)
	}
}
