package bellhop

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop/internal/pgtest"
	"github.com/bellhopq/bellhop/internal/syncbuf"
)

// TestStopBoundWithOutcomesQueued: a stop while the database is away keeps
// to its bound, max(ShutdownGrace, min(StatementTimeout, 5s)) +
// StopBudget, however many outcomes wait to be written. The Completer
// retries a batch until its leases end, and handlers whose outcomes
// queue behind it block in Submit; Run waited for those handlers before
// its budget started, so the stop lasted until the leases ended (38s in
// the review's run, with 3,000 outcomes and 40s leases). Here the
// Completer's queue holds 4 outcomes and 20 handlers finish at once.
//
// The database is away as a frozen server or a partition is: a dial hangs.
// Once the bound has passed, the stop's other writes are skipped: they got
// a budget of their own, and the busy marks' deletion waited all of it,
// 5s past the bound (a re-review's run: 15s against a bound of 10s).
func TestStopBoundWithOutcomesQueued(t *testing.T) {
	ctx := context.Background()
	const n = 20
	dsn, _, client := stopBoundApp(t, n)
	msgs := make([]NewMessage, n)
	for i := range msgs {
		msgs[i] = NewMessage{Queue: "q", Payload: []byte(`{}`)}
	}
	if _, err := client.EnqueueMany(ctx, "app", msgs); err != nil {
		t.Fatal(err)
	}

	cfg, away := awayConfig(t, dsn)
	var started atomic.Int32
	finish := make(chan struct{})
	mux := NewMux()
	mux.Handle("app", "q", HandlerFunc(func(context.Context, *Message) error {
		started.Add(1)
		<-finish
		return nil
	}))
	const grace = 500 * time.Millisecond
	logs := &syncbuf.Buffer{}
	d, err := NewDispatcher(cfg, DispatcherConfig{Resolver: mux, ShutdownGrace: grace, PollInterval: time.Hour, Logger: zerolog.New(logs)})
	if err != nil {
		t.Fatal(err)
	}
	d.outcomeBatch = 1
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ran := make(chan error, 1)
	go func() { ran <- d.Run(rctx) }()
	eventually(t, "every message in a handler", func() bool { return started.Load() == n })

	away.Store(true)
	close(finish)
	cancel()
	stopped := time.Now()
	bound := max(grace, min(DefaultStatementTimeout, 5*time.Second)) + StopBudget
	select {
	case err := <-ran:
		if err != nil {
			t.Errorf("Run: %v", err)
		}
		if took := time.Since(stopped); took > bound+2*time.Second {
			t.Errorf("Run returned %s after its stop, want within its bound of %s and slack", took.Round(time.Millisecond), bound)
		}
		if n := strings.Count(logs.String(), `"skipped":"hand-over, busy marks, last_fired_at"`); n != 1 {
			t.Errorf("%d lines say the stop skips the hand-over, the busy marks and last_fired_at, want 1:\n%s", n, logs.String())
		}
	case <-time.After(45 * time.Second):
		t.Fatalf("Run did not return within 45s of its stop (its bound: %s; the leases end 60s after the claim)", bound)
	}
}

// awayConfig returns a pool config for dsn whose database goes away, as
// a frozen server or a partition does, once away is set: no pooled
// connection is handed out, and a new one's dial hangs until its caller
// gives up.
func awayConfig(t *testing.T, dsn string) (*pgxpool.Config, *atomic.Bool) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	away := new(atomic.Bool)
	cfg.PrepareConn = func(context.Context, *pgx.Conn) (bool, error) { return !away.Load(), nil }
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if away.Load() {
			<-ctx.Done()
			return nil, fmt.Errorf("database away (test): %w", ctx.Err())
		}
		var d net.Dialer
		return d.DialContext(ctx, network, addr)
	}
	return cfg, away
}

// TestStopWritesEndAtTheBound: a handler that returns a little before the
// stop's bound leaves the stop's writes only what is left of it, not a
// whole StopBudget. Found by review: the budget started when the last
// handler returned, so one returning 1s before the bound, its outcome
// unwritable while the database was away, took Run 4s past it, and past
// a supervisor's kill set from the documented bound. The message, its
// outcome given up on, stays for its lease to run out.
func TestStopWritesEndAtTheBound(t *testing.T) {
	ctx := context.Background()
	dsn, pool, client := stopBoundApp(t, 1)
	if _, err := client.Enqueue(ctx, "app", "q", []byte(`{}`), EnqueueOptions{}); err != nil {
		t.Fatal(err)
	}
	cfg, away := awayConfig(t, dsn)
	started := make(chan struct{})
	finish := make(chan struct{})
	mux := NewMux()
	mux.Handle("app", "q", HandlerFunc(func(context.Context, *Message) error {
		close(started)
		<-finish // its context's end ignored
		return nil
	}))
	const grace = 500 * time.Millisecond
	d, err := NewDispatcher(cfg, DispatcherConfig{Resolver: mux, ShutdownGrace: grace, PollInterval: time.Hour, Logger: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ran := make(chan error, 1)
	go func() { ran <- d.Run(rctx) }()
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the message was not delivered within 10s")
	}

	away.Store(true)
	cancel()
	stopped := time.Now()
	bound := max(grace, min(DefaultStatementTimeout, 5*time.Second)) + StopBudget
	// The handler returns 1s before the bound: its ack cannot be written.
	returns := time.AfterFunc(bound-time.Second, func() { close(finish) })
	defer returns.Stop()
	select {
	case err := <-ran:
		if err != nil {
			t.Errorf("Run: %v", err)
		}
		if took := time.Since(stopped); took > bound+time.Second {
			t.Errorf("Run returned %s after its stop, want within its bound of %s and 1s", took.Round(time.Millisecond), bound)
		}
	case <-time.After(bound + 30*time.Second):
		t.Fatalf("Run did not return within %s of its stop", bound+30*time.Second)
	}
	var left int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM queue_messages").Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 1 {
		t.Errorf("%d messages left, want 1: the ack was never written", left)
	}
}

// stopBoundApp makes app "app" with a consumer of queue "q" (maxInFlight,
// leases of a minute) on a test database, and returns the database, a
// pool on it (closed when t ends) and a Client of that pool.
func stopBoundApp(t *testing.T, maxInFlight int) (string, *pgxpool.Pool, *Client) {
	t.Helper()
	ctx := context.Background()
	dsn := pgtest.ConnString(t)
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	client := NewClient(pool)
	if _, err := client.CreateApp(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	if _, err := client.RegisterConsumer(ctx, ConsumerSpec{App: "app", Queue: "q", MaxInFlight: maxInFlight, VisibilityTimeout: time.Minute}); err != nil {
		t.Fatal(err)
	}
	return dsn, pool, client
}
