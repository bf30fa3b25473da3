package bellhop_test

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/tern/v2/migrate"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgtest"
	"github.com/bellhopq/bellhop/migrations"
)

// TestRunFailsToStartCleanly: Run on a database without Bellhop's schema
// returns an error naming what is missing, and leaves nothing of its own
// running (the outcome writer is started before the consumers are read).
func TestRunFailsToStartCleanly(t *testing.T) {
	ctx := context.Background()
	cfg := emptyDatabase(t)

	writers := func() int {
		buf := make([]byte, 1<<22)
		return strings.Count(string(buf[:runtime.Stack(buf, true)]), "claim.(*Completer).loop")
	}
	before := writers()
	d, err := bellhop.NewDispatcher(cfg, bellhop.DispatcherConfig{Resolver: bellhop.NewMux()})
	if err != nil {
		t.Fatal(err)
	}
	err = d.Run(ctx)
	if err == nil || !strings.Contains(err.Error(), "no Bellhop schema") {
		t.Fatalf("Run on an empty database: %v, want an error saying the schema is missing", err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for writers() > before {
		if time.Now().After(deadline) {
			t.Fatalf("%d outcome writers still running after Run failed, %d before", writers(), before)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestRunRefusesOlderSchema: Run refuses a database whose schema is older
// than the code, naming both versions. It used to start, deliver new
// messages, and fail every reclaim pass on a function the old schema
// lacks, so a crashed dispatcher's leases were never returned.
func TestRunRefusesOlderSchema(t *testing.T) {
	ctx := context.Background()
	cfg := emptyDatabase(t)
	conn, err := pgx.ConnectConfig(ctx, cfg.ConnConfig)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	m, err := migrate.NewMigrator(ctx, conn, migrations.VersionTable)
	if err != nil {
		t.Fatal(err)
	}
	files, err := migrations.Files()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		m.AppendMigration(f.Name, f.SQL, "")
	}
	if err := m.MigrateTo(ctx, int32(len(files)-1)); err != nil { // all but the last
		t.Fatal(err)
	}
	d, err := bellhop.NewDispatcher(cfg, bellhop.DispatcherConfig{Resolver: bellhop.NewMux()})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	err = d.Run(rctx)
	if !errors.Is(err, migrations.ErrSchemaBehind) || !strings.Contains(err.Error(), "bellhop migrate") {
		t.Fatalf("Run on a schema one migration behind: %v, want ErrSchemaBehind telling to run bellhop migrate", err)
	}
}

// emptyDatabase creates a database without Bellhop's schema, dropped when
// the test ends, and returns a pool config for it.
func emptyDatabase(t *testing.T) *pgxpool.Config {
	t.Helper()
	ctx := context.Background()
	name := "bellhop_bare_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	admin, err := pgx.Connect(ctx, pgtest.AdminConnString())
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+name+" TEMPLATE template0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if c, err := pgx.Connect(context.Background(), pgtest.AdminConnString()); err == nil {
			_, _ = c.Exec(context.Background(), "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)")
			_ = c.Close(context.Background())
		}
	})
	cfg, err := pgxpool.ParseConfig(pgtest.AdminConnString())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Database = name
	return cfg
}
