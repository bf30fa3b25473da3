package bellhop_test

import (
	"context"
	"errors"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/tern/v2/migrate"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgtest"
	"github.com/bellhopq/bellhop/internal/syncbuf"
	"github.com/bellhopq/bellhop/migrations"
	queries "github.com/bellhopq/bellhop/sql"
)

// TestRunFailsToStartCleanly: Run on a database without Bellhop's schema
// returns an error naming what is missing, and leaves nothing of its own
// running: not the outcome writer, started before the consumers are read,
// and not the listener, which connects beside the schema check (it is
// stopped, and its goroutines have ended, when Run returns).
func TestRunFailsToStartCleanly(t *testing.T) {
	ctx := context.Background()
	cfg := emptyDatabase(t)

	// Frames, not "created by" lines: a goroutine that has returned from
	// its function and is being torn down shows runtime.goexit1, hidden,
	// and its creator's line (CI counted the listener's child so, once,
	// right after Run returned; a scratch loop under -race saw such stacks
	// in 547 of 200,000 dumps taken right after the child's send).
	running := func(frame string) int {
		buf := make([]byte, 1<<22)
		n := 0
		for line := range strings.Lines(string(buf[:runtime.Stack(buf, true)])) {
			if strings.Contains(line, frame) && !strings.HasPrefix(line, "created by ") {
				n++
			}
		}
		return n
	}
	writers := func() int { return running("claim.(*Completer).loop") }
	before, listenersBefore := writers(), running("notify.(*Listener).Run")
	d, err := bellhop.NewDispatcher(cfg, bellhop.DispatcherConfig{Resolver: bellhop.NewMux()})
	if err != nil {
		t.Fatal(err)
	}
	err = d.Run(ctx)
	if err == nil || !strings.Contains(err.Error(), "no Bellhop schema") {
		t.Fatalf("Run on an empty database: %v, want an error saying the schema is missing", err)
	}
	if n := running("notify.(*Listener).Run"); n > listenersBefore {
		t.Errorf("%d listeners still running when Run returned its error, %d before", n, listenersBefore)
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
	latest, err := migrations.Latest()
	if err != nil {
		t.Fatal(err)
	}
	cfg := emptyDatabase(t)
	migrateTo(t, cfg, latest-1) // all but the last
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

// migrateTo applies the embedded migrations to cfg's database up to
// schema version v, as the release that shipped migration v would have.
func migrateTo(t *testing.T, cfg *pgxpool.Config, v int) {
	t.Helper()
	ctx := context.Background()
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
	if err := m.MigrateTo(ctx, int32(v)); err != nil {
		t.Fatalf("migrate to version %d: %v", v, err)
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

// TestRefusedBusyCheckStillDelivers: a queue lane that has dropped its
// busy mark checks, before it claims again, that no producer who saw the
// mark is still committing (busy_lock.sql). When that check keeps failing
// (here a privilege revoked from the dispatcher's role), the lane claims
// all the same and retries the check with a backoff. It used to return
// before claiming, so the queue was never claimed again for as long as
// the check failed.
func TestRefusedBusyCheckStillDelivers(t *testing.T) {
	e := fxNew(t)
	e.app("app")
	if _, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "app", Queue: "q", MaxInFlight: 1}); err != nil {
		t.Fatal(err)
	}
	// The dispatcher logs in with bellhop_dispatcher's rights only
	// (docs/roles.sql), so that a privilege revoked from PUBLIC is refused
	// to it. busy_lock.sql is the only statement that calls
	// pg_try_advisory_xact_lock(bigint).
	script, err := os.ReadFile("docs/roles.sql")
	if err != nil {
		t.Fatal(err)
	}
	e.exec(string(script))
	dsn := e.login("bh_dispatcher_", "bellhop_dispatcher")
	e.exec(`REVOKE EXECUTE ON FUNCTION pg_try_advisory_xact_lock(bigint) FROM PUBLIC`)

	started := make(chan string, 2)
	var m4At atomic.Int64 // when m4's handler started, in Unix nanoseconds
	mux := bellhop.NewMux()
	mux.Handle("app", "q", bellhop.HandlerFunc(func(_ context.Context, m *bellhop.Message) error {
		name := strings.Trim(string(m.Payload), `"`)
		if name == "m4" {
			m4At.Store(time.Now().UnixNano())
		}
		started <- name
		return nil
	}))
	logs := &lineLog{}
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	checks := &statementTimes{sql: queries.BusyLock}
	cfg.ConnConfig.Tracer = checks
	runDispatcherOn(t, cfg, mux, func(dc *bellhop.DispatcherConfig) {
		dc.Logger = zerolog.New(zerolog.MultiLevelWriter(zerolog.NewTestWriter(t), logs)).Level(zerolog.WarnLevel)
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

	// m1 fills the only slot, so the lane marks the queue busy; once the
	// queue is empty it drops the mark, and the check is refused.
	send("m1")
	expect("m1")
	smokeWait(t, 10*time.Second, "the queue lane's busy-lock check refused", func() bool {
		return strings.Contains(logs.String(), "permission denied for function pg_try_advisory_xact_lock")
	})
	// The lane is settling, and every check fails: m2 is claimed anyway.
	send("m2")
	expect("m2")
	// The check is retried backing off, 0.5 – 1s, 1 – 2s, 2 – 4s ...
	// after the first, second, third failure in a row, although the
	// claims between them succeed: the claims' backoff, which each
	// restarts, retried it every 0.5 – 1s for as long as it failed.
	// Wait for the fourth to be refused, not just sent: one still on its
	// way to the server when the GRANT below commits succeeds, the lane
	// settles, and no fifth check is due.
	smokeWait(t, 20*time.Second, "four refused busy-lock checks", func() bool { return checks.failures() >= 4 })
	at := checks.times()
	for i := range at {
		t.Logf("check %d at %s", i, at[i].Sub(at[0]))
	}
	if gap := at[3].Sub(at[2]); gap < 1900*time.Millisecond {
		t.Errorf("the fourth refused check came %s after the third, want 2 – 4s: not backing off", gap.Round(time.Millisecond))
	}

	// The check works again, and the next is 4 – 8s away. A drain's
	// unmark, whose own check answers, ends the settle left pending: the
	// lane neither claims every 20ms until the next check is due, nor
	// checks again (it used to check once more, at once).
	// The unmark waited for is the drain's after m4: on a loaded machine
	// m3's delivery can end its own busy period before m4 is enqueued,
	// and m4's then claims on after that first drain's unmark.
	e.exec(`GRANT EXECUTE ON FUNCTION pg_try_advisory_xact_lock(bigint) TO PUBLIC`)
	send("m3")
	send("m4")
	expect("m3")
	expect("m4")
	smokeWait(t, 10*time.Second, "the drain's unmark after m4", func() bool { return checks.lastUnmark.Load() > m4At.Load() })
	seen, claims := len(checks.times()), checks.claims.Load()
	for end := time.Now().Add(time.Second); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		if n := len(checks.times()); n > seen {
			t.Fatalf("%d more busy-lock checks after the drain's unmark answered", n-seen)
		}
		// The pass after the unmark's check, and those the end of m4's
		// delivery may wake; a settle claimed every 20 ms.
		if n := checks.claims.Load() - claims; n > 3 {
			t.Fatalf("%d claims after the drain's unmark answered: the settle goes on", n)
		}
	}
	send("m5")
	expect("m5")
}

// statementTimes records when a pool sent one statement, alone, and how
// many of those failed, as its tracer; lastUnmark is when it was last
// sent in a batch (claim.Unmark's), in Unix nanoseconds, and claims counts
// the queue claims, alone or in a batch.
type statementTimes struct {
	sql        string
	mu         sync.Mutex
	at         []time.Time
	failed     int
	lastUnmark atomic.Int64
	claims     atomic.Int64
}

// isQueueClaimSQL tells sql/claim_queue.sql from the other statements.
func isQueueClaimSQL(sql string) bool {
	return strings.Contains(sql, "SET claim_token = gen_random_uuid()") && strings.Contains(sql, "FROM queue_messages AS c")
}

func (s *statementTimes) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	for _, q := range d.Batch.QueuedQueries {
		if isQueueClaimSQL(q.SQL) {
			s.claims.Add(1)
		}
		if q.SQL == s.sql {
			s.lastUnmark.Store(time.Now().UnixNano())
		}
	}
	return ctx
}

func (s *statementTimes) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (s *statementTimes) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// tracedStatement marks the context of a statement statementTimes counts.
type tracedStatement struct{}

func (s *statementTimes) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if isQueueClaimSQL(d.SQL) {
		s.claims.Add(1)
	}
	if d.SQL != s.sql {
		return ctx
	}
	s.mu.Lock()
	s.at = append(s.at, time.Now())
	s.mu.Unlock()
	return context.WithValue(ctx, tracedStatement{}, true)
}

func (s *statementTimes) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryEndData) {
	if ctx.Value(tracedStatement{}) != nil && d.Err != nil {
		s.mu.Lock()
		s.failed++
		s.mu.Unlock()
	}
}

// failures is how many of the statements have failed so far.
func (s *statementTimes) failures() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.failed
}

func (s *statementTimes) times() []time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.at)
}

// lineLog keeps a dispatcher's log, for a test to wait for a line.
type lineLog = syncbuf.Buffer

// TestClientWithoutSchema: every Client method on a database without
// Bellhop's schema fails with an error wrapping migrations.ErrNoSchema,
// which says to run `bellhop migrate`, with the database's error kept in
// the chain; on one whose schema is behind, with
// migrations.ErrSchemaBehind. They returned the bare "relation \"apps\"
// does not exist (SQLSTATE 42P01)". A missing object on a current schema
// (not Bellhop's doing) is left as the database said it.
// tableOrFunction are the SQLSTATEs of a missing table or function.
var tableOrFunction = []string{"42P01", "42883"}

func TestClientWithoutSchema(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	emptyCfg := emptyDatabase(t)
	empty, err := pgxpool.NewWithConfig(ctx, emptyCfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(empty.Close)
	// A migrated database whose apps table is gone: at the version before
	// this code's, and at this code's.
	broken := func(behind bool) *pgxpool.Pool {
		e := fxNew(t)
		e.exec(`ALTER TABLE apps RENAME TO apps_gone`)
		if behind {
			e.exec(`UPDATE ` + migrations.VersionTable + ` SET version = version - 1`)
		}
		return e.pool
	}
	// One whose apps table lacks a column this code reads, as a later
	// migration's column would be missing.
	columnBehind := func() *pgxpool.Pool {
		e := fxNew(t)
		e.exec(`ALTER TABLE apps RENAME COLUMN name TO name_gone`)
		e.exec(`UPDATE ` + migrations.VersionTable + ` SET version = version - 1`)
		return e.pool
	}
	ptr := func(n int) *int { return &n }
	type call struct {
		name string
		do   func(c *bellhop.Client) error
	}
	calls := []call{
		{"CreateApp", func(c *bellhop.Client) error { _, err := c.CreateApp(ctx, "shop"); return err }},
		{"Apps", func(c *bellhop.Client) error { _, err := c.Apps(ctx); return err }},
		{"CreatePrincipal", func(c *bellhop.Client) error { _, err := c.CreatePrincipal(ctx, "shop", "p"); return err }},
		{"Enqueue", func(c *bellhop.Client) error {
			_, err := c.Enqueue(ctx, "shop", "orders", []byte(`1`), bellhop.EnqueueOptions{})
			return err
		}},
		{"EnqueueMany", func(c *bellhop.Client) error {
			_, err := c.EnqueueMany(ctx, "shop", []bellhop.NewMessage{{Queue: "orders", Payload: []byte(`1`)}, {Queue: "orders", Payload: []byte(`2`)}})
			return err
		}},
		{"EnqueueTx", func(c *bellhop.Client) error {
			tx, err := empty.Begin(ctx)
			if err != nil {
				return err
			}
			defer tx.Rollback(ctx)
			_, err = c.EnqueueTx(ctx, tx, "shop", "orders", []byte(`1`), bellhop.EnqueueOptions{})
			return err
		}},
		{"InvokeAsync", func(c *bellhop.Client) error {
			_, err := c.InvokeAsync(ctx, uuid.New(), []byte(`1`), bellhop.EnqueueOptions{})
			return err
		}},
		{"RegisterConsumer", func(c *bellhop.Client) error {
			_, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders"})
			return err
		}},
		{"UpdateConsumer", func(c *bellhop.Client) error {
			return c.UpdateConsumer(ctx, "shop", uuid.New(), bellhop.ConsumerUpdate{MaxAttempts: ptr(2)})
		}},
		{"SetConsumerEnabled", func(c *bellhop.Client) error { return c.SetConsumerEnabled(ctx, "shop", uuid.New(), false) }},
		{"RemoveConsumer", func(c *bellhop.Client) error { return c.RemoveConsumer(ctx, "shop", uuid.New()) }},
		{"Consumers", func(c *bellhop.Client) error { _, err := c.Consumers(ctx, ""); return err }},
		{"ConsumerOf", func(c *bellhop.Client) error { _, err := c.ConsumerOf(ctx, "shop", "orders"); return err }},
		{"DeadLetters", func(c *bellhop.Client) error { _, err := c.DeadLetters(ctx, bellhop.DeadFilter{}); return err }},
		{"Redrive", func(c *bellhop.Client) error { _, err := c.Redrive(ctx, "shop", "orders", uuid.Nil); return err }},
		{"PurgeDead", func(c *bellhop.Client) error { _, err := c.PurgeDead(ctx, "shop", "", uuid.Nil); return err }},
		{"Queues", func(c *bellhop.Client) error { _, err := c.Queues(ctx, ""); return err }},
		{"QueuedMessage", func(c *bellhop.Client) error { _, err := c.QueuedMessage(ctx, "shop", uuid.New()); return err }},
		{"DeleteMessage", func(c *bellhop.Client) error { return c.DeleteMessage(ctx, "shop", uuid.New()) }},
		{"PurgeQueue", func(c *bellhop.Client) error { _, err := c.PurgeQueue(ctx, "shop", "orders"); return err }},
		{"As(p).Queues", func(c *bellhop.Client) error { _, err := c.As(uuid.New()).Queues(ctx, ""); return err }},
	}
	for _, db := range []struct {
		name  string
		pool  *pgxpool.Pool
		calls []call
		want  error // nil: neither ErrNoSchema nor ErrSchemaBehind
		codes []string
	}{
		{"no schema", empty, calls, migrations.ErrNoSchema, tableOrFunction},
		{"schema behind", broken(true), calls[:2], migrations.ErrSchemaBehind, tableOrFunction},
		{"schema current", broken(false), calls[:2], nil, tableOrFunction},
		// Found by review: a missing column (42703), the usual sign of
		// an older schema, was returned bare.
		{"column behind", columnBehind(), calls[:2], migrations.ErrSchemaBehind, []string{"42703"}},
	} {
		c := bellhop.NewClient(db.pool)
		for _, call := range db.calls {
			t.Run(db.name+"/"+call.name, func(t *testing.T) {
				err := call.do(c)
				var pgErr *pgconn.PgError
				if !errors.As(err, &pgErr) || !slices.Contains(db.codes, pgErr.Code) {
					t.Fatalf("%s: %v; want the database's error (SQLSTATE %v) in the chain", call.name, err, db.codes)
				}
				noSchema, behind := errors.Is(err, migrations.ErrNoSchema), errors.Is(err, migrations.ErrSchemaBehind)
				switch {
				case db.want == nil && (noSchema || behind):
					t.Errorf("%s: %v; want the database's error as it is", call.name, err)
				case db.want != nil && (!errors.Is(err, db.want) || strings.Count(err.Error(), "bellhop migrate") != 1):
					t.Errorf("%s: %v; want %q once, with the database's error", call.name, err, db.want)
				}
			})
		}
	}
}
