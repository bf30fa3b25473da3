package bellhop

import (
	"context"
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop/internal/pgtest"
)

// TestStopBoundWithOutcomesQueued: a stop while the database is away keeps
// to its bound, max(ShutdownGrace, min(StatementTimeout, 5s)) +
// StopBudget, however many outcomes wait to be written. The Completer
// retries a batch until its leases end, and handlers whose outcomes
// queue behind it block in Submit; Run waited for those handlers before
// its budget started, so the stop lasted until the leases ended (38s in
// the review's run, with 3,000 outcomes and 40s leases). Here the
// Completer's queue holds 4 outcomes and 20 handlers finish at once.
func TestStopBoundWithOutcomesQueued(t *testing.T) {
	ctx := context.Background()
	dsn := pgtest.ConnString(t)
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	client := NewClient(pool)
	if _, err := client.CreateApp(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	const n = 20
	if _, err := client.RegisterConsumer(ctx, ConsumerSpec{App: "app", Queue: "q", MaxInFlight: n, VisibilityTimeout: time.Minute}); err != nil {
		t.Fatal(err)
	}
	msgs := make([]NewMessage, n)
	for i := range msgs {
		msgs[i] = NewMessage{Queue: "q", Payload: []byte(`{}`)}
	}
	if _, err := client.EnqueueMany(ctx, "app", msgs); err != nil {
		t.Fatal(err)
	}

	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	// Away: no pooled connection is handed out, and no new one is made.
	var away atomic.Bool
	cfg.PrepareConn = func(context.Context, *pgx.Conn) (bool, error) { return !away.Load(), nil }
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if away.Load() {
			return nil, errors.New("database away (test)")
		}
		var d net.Dialer
		return d.DialContext(ctx, network, addr)
	}
	var started atomic.Int32
	finish := make(chan struct{})
	mux := NewMux()
	mux.Handle("app", "q", HandlerFunc(func(context.Context, *Message) error {
		started.Add(1)
		<-finish
		return nil
	}))
	const grace = 500 * time.Millisecond
	d, err := NewDispatcher(cfg, DispatcherConfig{Resolver: mux, ShutdownGrace: grace, PollInterval: time.Hour, Logger: zerolog.Nop()})
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
		if took := time.Since(stopped); took > bound+5*time.Second {
			t.Errorf("Run returned %s after its stop, want within its bound of %s and slack", took.Round(time.Millisecond), bound)
		}
	case <-time.After(45 * time.Second):
		t.Fatalf("Run did not return within 45s of its stop (its bound: %s; the leases end 60s after the claim)", bound)
	}
}
