package bellhop_test

import (
	"context"
	"errors"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/tern/v2/migrate"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgdsn"
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

// TestFailedPassHandsSlotBack: a consumer with one slot, and both its
// lanes (queue messages, invoke deliveries) waiting for it. The invoke
// lane's delivery ends and hands the slot to the queue lane, whose pass
// then fails before it takes the slot: its busy-lock check is refused, by
// a privilege revoked from the dispatcher's role. The slot must go back to
// the invoke lane at once. It used to wait for the failed lane's retry,
// which backs off from 1s to 10s; here for ever, since every retry fails
// the same way and nothing else wakes the invoke lane.
func TestFailedPassHandsSlotBack(t *testing.T) {
	e := fxNew(t)
	e.app("app")
	c, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "app", Queue: "q", MaxInFlight: 1})
	if err != nil {
		t.Fatal(err)
	}
	// The dispatcher logs in with bellhop_dispatcher's rights only
	// (docs/roles.sql), so that a privilege revoked from PUBLIC is refused
	// to it. busy_lock.sql, the check of a queue lane that drops its busy
	// mark and then settles, is the only statement that calls
	// pg_try_advisory_xact_lock(bigint).
	script, err := os.ReadFile("docs/roles.sql")
	if err != nil {
		t.Fatal(err)
	}
	e.exec(string(script))
	login := "bh_dispatcher_" + uuid.NewString()[:8]
	e.exec(`CREATE ROLE ` + login + ` LOGIN IN ROLE bellhop_dispatcher`)
	// Cleanups run last-in first-out: the role is dropped after the
	// dispatcher has closed its connections.
	t.Cleanup(func() { _, _ = pgxpoolExec(pgtest.AdminConnString(), `DROP ROLE IF EXISTS `+login) })
	dsn, err := pgdsn.WithUser(e.pool.Config().ConnConfig.ConnString(), login)
	if err != nil {
		t.Fatal(err)
	}
	e.exec(`REVOKE EXECUTE ON FUNCTION pg_try_advisory_xact_lock(bigint) FROM PUBLIC`)

	// Each delivery, named by its payload, runs until its gate opens.
	gates := map[string]chan struct{}{}
	for _, name := range []string{"m1", "m2", "d1", "d2"} {
		gates[name] = make(chan struct{})
	}
	var gateMu sync.Mutex
	open := func(name string) {
		gateMu.Lock()
		defer gateMu.Unlock()
		select {
		case <-gates[name]:
		default:
			close(gates[name])
		}
	}
	open("m1")
	started := make(chan string, len(gates))
	mux := bellhop.NewMux()
	mux.Handle("app", "q", bellhop.HandlerFunc(func(_ context.Context, m *bellhop.Message) error {
		name := strings.Trim(string(m.Payload), `"`)
		started <- name
		<-gates[name]
		return nil
	}))
	logs := &lineLog{}
	d := runDispatcher(t, dsn, mux, func(dc *bellhop.DispatcherConfig) {
		dc.Logger = zerolog.New(zerolog.MultiLevelWriter(zerolog.NewTestWriter(t), logs)).Level(zerolog.WarnLevel)
	})
	t.Cleanup(func() { // before the dispatcher's stop, should the test fail
		for name := range gates {
			open(name)
		}
	})
	expect := func(want string) {
		t.Helper()
		select {
		case got := <-started:
			if got != want {
				t.Fatalf("delivered %s, want %s", got, want)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%s not delivered within 10s", want)
		}
	}
	send := func(name string) {
		t.Helper()
		if _, err := e.client.Enqueue(e.ctx, "app", "q", []byte(`"`+name+`"`), bellhop.EnqueueOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	invoke := func(name string) {
		t.Helper()
		if _, err := e.client.InvokeAsync(e.ctx, c.ID, []byte(`"`+name+`"`), bellhop.EnqueueOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	// m1 fills the slot, so the queue lane marks the queue busy; once it
	// finds the queue empty it drops the mark, and its busy-lock check
	// fails. The lane now settles: each of its passes that finds a free
	// slot fails at the check, before it takes the slot.
	send("m1")
	expect("m1")
	smokeWait(t, 10*time.Second, "the queue lane's busy-lock check refused", func() bool {
		return strings.Contains(logs.String(), "permission denied for function pg_try_advisory_xact_lock")
	})
	// d1 takes the slot; d2 and m2 wait for it, and so do both lanes.
	invoke("d1")
	expect("d1")
	invoke("d2")
	send("m2")
	smokeWait(t, 10*time.Second, "both lanes waiting for the slot", func() bool {
		q, i := bellhop.LaneBacklogs(d, c)
		return q && i
	})

	// d1's end hands the slot to the queue lane, whose pass fails at the
	// check; the slot goes back to the invoke lane, for d2. The failed
	// lane's own retry is at least 1s away (its second failure in a row).
	const prompt = 500 * time.Millisecond
	freed := time.Now()
	open("d1")
	select {
	case got := <-started:
		if got != "d2" {
			t.Fatalf("delivered %s once d1 had ended, want d2", got)
		}
		t.Logf("d2 delivered %s after d1 ended", time.Since(freed).Round(time.Millisecond))
	case <-time.After(prompt):
		t.Fatalf("d2 not delivered within %s of d1's end: the queue lane kept the slot it was handed though its pass failed", prompt)
	}
	if n := e.int64(`SELECT count(*) FROM queue_messages WHERE claim_token IS NULL`); n != 1 {
		t.Errorf("%d unclaimed queue messages, want 1 (m2): every pass of the queue lane should fail at its check", n)
	}
}

// lineLog keeps a dispatcher's log, for a test to wait for a line.
type lineLog struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lineLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lineLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
