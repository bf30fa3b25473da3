package integration

import (
	"context"
	"encoding/json"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgtest"
)

// env is one test's database, with a producer pool and client on it.
type env struct {
	dsn    string
	pool   *pgxpool.Pool
	client *bellhop.Client
}

// newEnv makes a fresh migrated database with one app, "app".
func newEnv(t *testing.T) *env {
	t.Helper()
	dsn := pgtest.ConnString(t)
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 12
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	e := &env{dsn: dsn, pool: pool, client: bellhop.NewClient(pool)}
	if _, err := e.client.CreateApp(context.Background(), "app"); err != nil {
		t.Fatal(err)
	}
	return e
}

// busyKeyHeld counts the sessions holding the busy key of app's queue
// (busy_hold.sql), a one-bigint advisory key (migration 0052).
const busyKeyHeld = `SELECT count(*) FROM pg_locks
	WHERE locktype = 'advisory' AND objsubid = 1 AND granted
	  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
	  AND ((classid::bigint << 32) | objid::bigint) =
	      hashtextextended((SELECT id FROM apps WHERE name = 'app')::text || ':' || $1::text, 1650814062)`

// consumer registers the consumer of app's queue.
func (e *env) consumer(t *testing.T, spec bellhop.ConsumerSpec) bellhop.Consumer {
	t.Helper()
	spec.App = "app"
	c, err := e.client.RegisterConsumer(context.Background(), spec)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func (e *env) enqueue(t *testing.T, queue string, payload any, opts bellhop.EnqueueOptions) uuid.UUID {
	t.Helper()
	b, err := json.Marshal(payload)
	if err != nil {
		t.Fatal(err)
	}
	id, err := e.client.Enqueue(context.Background(), "app", queue, b, opts)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// tryEnqueue is enqueue for a goroutine other than the test's, where
// t.Fatal must not be called: it returns the error instead.
func (e *env) tryEnqueue(queue string, payload any, opts bellhop.EnqueueOptions) (uuid.UUID, error) {
	b, err := json.Marshal(payload)
	if err != nil {
		return uuid.Nil, err
	}
	return e.client.Enqueue(context.Background(), "app", queue, b, opts)
}

// count runs a count(*) query.
func (e *env) count(t *testing.T, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := e.pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// testLogger writes the dispatcher's log to the test's log.
func testLogger(t *testing.T) zerolog.Logger {
	return zerolog.New(zerolog.NewTestWriter(t)).With().Timestamp().Logger()
}

// running is a Dispatcher started by startDispatcher.
type running struct {
	*bellhop.Dispatcher
	stop func() // cancels Run and waits for it to return; idempotent
}

// waitNoLockWaiters waits until no session of e's database waits for a
// lock. A statement cut off by its timeout is cancelled on the server by a
// cancel request that can land late: were the lock it waits for released
// first, it would still run, and its effect would pass for a retry's.
func (e *env) waitNoLockWaiters(t *testing.T) {
	t.Helper()
	waitFor(t, 10*time.Second, "no session waiting for a lock", func() bool {
		return e.count(t, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`) == 0
	})
}

// startDispatcher starts a Dispatcher on dsn and waits until it is ready:
// its listener is connected, so every notification from now on is heard.
// tweak, if set, edits the pool config first. Its log goes to t's. The dispatcher is stopped
// when t ends, if not before.
func startDispatcher(t *testing.T, dsn string, cfg bellhop.DispatcherConfig, tweak func(*pgxpool.Config)) *running {
	t.Helper()
	cfg.Logger = testLogger(t)
	return startLogged(t, dsn, cfg, tweak)
}

// startLogged is startDispatcher with the log cfg.Logger gives.
func startLogged(t *testing.T, dsn string, cfg bellhop.DispatcherConfig, tweak func(*pgxpool.Config)) *running {
	t.Helper()
	pc, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	if tweak != nil {
		tweak(pc)
	}
	d, err := bellhop.NewDispatcher(pc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("Dispatcher.Run: %v", err)
				}
			case <-time.After(30 * time.Second):
				t.Errorf("Dispatcher.Run did not return within 30s of its cancel")
			}
		})
	}
	t.Cleanup(stop)
	waitFor(t, 10*time.Second, "dispatcher ready", func() bool {
		select {
		case err := <-done:
			t.Fatalf("Dispatcher.Run returned early: %v", err)
		default:
		}
		return d.Ready(context.Background()) == nil
	})
	return &running{Dispatcher: d, stop: stop}
}

// waitFor polls cond every 5ms until it holds, and fails t if it does not
// within timeout.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// holdsFor polls cond every 10ms for the whole of d and fails t the
// first time it does not hold: the way to check that something does
// not happen.
func holdsFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	end := time.Now().Add(d)
	for time.Now().Before(end) {
		if !cond() {
			t.Fatalf("%s stopped holding", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// delivery is one handler call, as a handler saw it.
type delivery struct {
	ID      uuid.UUID
	Attempt int
	Invoked bool
	Payload json.RawMessage
	Start   time.Time
	End     time.Time
}

// recorder is a handler that records its calls and then returns what
// result says (nil: ack).
type recorder struct {
	result func(ctx context.Context, m *bellhop.Message) error

	mu    sync.Mutex
	calls []delivery
	n     atomic.Int32
}

func (r *recorder) Handle(ctx context.Context, m *bellhop.Message) (err error) {
	d := delivery{ID: m.ID, Attempt: m.Attempt, Invoked: m.Invoked, Payload: m.Payload, Start: time.Now()}
	defer func() {
		d.End = time.Now()
		r.mu.Lock()
		r.calls = append(r.calls, d)
		r.mu.Unlock()
		r.n.Add(1)
	}()
	if r.result == nil {
		return nil
	}
	return r.result(ctx, m)
}

// deliveries returns a copy of the calls that have finished.
func (r *recorder) deliveries() []delivery {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]delivery(nil), r.calls...)
}

// claimCounter is a pgx tracer that counts statements that claim rows:
// every one for which isClaim holds, run alone or in a
// batch (the claim statements run in a batch, which a QueryTracer alone
// does not see). ended counts the batches holding one that have finished.
// dispatcherSessions is the FROM clause of the sessions of the dispatcher's
// pool in the test's database (not its listener's, nor its busy locks').
const dispatcherSessions = `FROM pg_stat_activity WHERE application_name = 'bellhop-dispatcher' AND datname = current_database()`

// noQueryTrace is the pgx.QueryTracer part of a tracer that follows
// something else (batches, the pool's acquires).
type noQueryTrace struct{}

func (noQueryTrace) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (noQueryTrace) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// claimCounter counts claim passes (and wake scans) as a pgx tracer.
// queue counts the queue claims alone (sql/claim_queue.sql), without the
// reclaim passes; invoke the invoke claims (sql/claim_invoke.sql).
type claimCounter struct{ n, ended, scans, queue, invoke atomic.Int64 }

// isQueueClaim tells sql/claim_queue.sql from the other statements.
func isQueueClaim(sql string) bool {
	return strings.Contains(sql, "SET claim_token = gen_random_uuid()") && strings.Contains(sql, "FROM queue_messages AS c")
}

// isInvokeClaim tells sql/claim_invoke.sql from the other statements.
func isInvokeClaim(sql string) bool {
	return strings.Contains(sql, "SET claim_token = gen_random_uuid()") && strings.Contains(sql, "FROM outbox AS c")
}

// wakeScanMarker is in the statement a dispatcher runs after it connects
// to find the lanes to wake (sql/wake_scan.sql).
const wakeScanMarker = "AS queue_lanes"

// waitQuiet waits until no claim pass has started or been in flight for
// quiet: the dispatcher's lanes have gone to sleep. A lane that found a
// stream of messages polls for DefaultBusyWindow after the last one, then
// settles with a few more statements; quiet is chosen well above that.
func (c *claimCounter) waitQuiet(t *testing.T, timeout, quiet time.Duration, what string) {
	t.Helper()
	var last int64 = -1
	lastChange := time.Now()
	waitFor(t, timeout, what, func() bool {
		if n := c.n.Load(); n != last || c.ended.Load() != n {
			last, lastChange = n, time.Now()
			return false
		}
		return last > 0 && time.Since(lastChange) >= quiet
	})
}

const claimMarker = "FOR UPDATE SKIP LOCKED"

// isClaim tells the claim and reclaim statements from the others that lock
// with SKIP LOCKED: the poll and the offers' statements
// (migrations/0044_lease_at_insert.sql), which name bellhop_offers.
func isClaim(sql string) bool {
	return strings.Contains(sql, claimMarker) && !strings.Contains(sql, "bellhop_offers")
}

type claimBatchKey struct{}

func (c *claimCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if isClaim(d.SQL) {
		c.n.Add(1)
	}
	if isQueueClaim(d.SQL) {
		c.queue.Add(1)
	}
	if isInvokeClaim(d.SQL) {
		c.invoke.Add(1)
	}
	if strings.Contains(d.SQL, wakeScanMarker) {
		return context.WithValue(ctx, wakeScanKey{}, true)
	}
	return ctx
}

type wakeScanKey struct{}

func (c *claimCounter) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	if scan, _ := ctx.Value(wakeScanKey{}).(bool); scan {
		c.scans.Add(1)
	}
}

func (c *claimCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	claims := false
	for _, q := range d.Batch.QueuedQueries {
		if isClaim(q.SQL) {
			c.n.Add(1)
			claims = true
		}
		if isQueueClaim(q.SQL) {
			c.queue.Add(1)
		}
		if isInvokeClaim(q.SQL) {
			c.invoke.Add(1)
		}
	}
	return context.WithValue(ctx, claimBatchKey{}, claims)
}

func (c *claimCounter) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (c *claimCounter) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchEndData) {
	if claims, _ := ctx.Value(claimBatchKey{}).(bool); claims {
		c.ended.Add(1)
	}
}

// deadLetter is a dead_letters row.
type deadLetter struct {
	Source    string
	Queue     string
	TriggerID *uuid.UUID
	Attempt   int
	Max       int
	LastError string
}

// deadLetterOf returns the dead letter of message id, if there is one.
func (e *env) deadLetterOf(t *testing.T, id uuid.UUID) (deadLetter, bool) {
	t.Helper()
	var d deadLetter
	err := e.pool.QueryRow(context.Background(),
		`SELECT source, queue_name, trigger_id, attempt, max_attempts, last_error FROM dead_letters WHERE id = $1`, id).
		Scan(&d.Source, &d.Queue, &d.TriggerID, &d.Attempt, &d.Max, &d.LastError)
	if err == pgx.ErrNoRows {
		return d, false
	}
	if err != nil {
		t.Fatal(err)
	}
	return d, true
}
