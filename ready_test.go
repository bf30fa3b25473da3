package bellhop

import (
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop/internal/pgtest"
)

// TestReadyChecksDatabaseOncePerSecond: Ready called many times at once,
// and then in a tight loop, as an unauthenticated /readyz can be, checks
// the database once in flight and once a second while it answers, rather
// than taking one of the pool's connections, which the lanes' claims
// need, per call. Found by review: every call pinged through the pool.
func TestReadyChecksDatabaseOncePerSecond(t *testing.T) {
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(pgtest.ConnString(t))
	if err != nil {
		t.Fatal(err)
	}
	d := readyDispatcher(t, cfg)

	acquires := func() int64 { return d.pool.Load().Stat().AcquireCount() }
	before, start := acquires(), time.Now()
	const calls = 200
	var wg sync.WaitGroup
	errs := make(chan error, calls)
	for range calls {
		wg.Go(func() { errs <- d.Ready(ctx) })
	}
	wg.Wait()
	for range calls {
		if err := d.Ready(ctx); err != nil {
			t.Fatalf("Ready in a loop: %v", err)
		}
	}
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("Ready called concurrently: %v", err)
		}
	}
	// One check a second, plus one for a second that had begun; the slack
	// also covers the statements a dispatcher makes just after it starts
	// (its consumer reload, a wake scan).
	took, n := time.Since(start), acquires()-before
	if limit := int64(took/time.Second) + 2; n > limit {
		t.Errorf("%d calls of Ready in %s took %d pool connections, want at most %d", 2*calls, took.Round(time.Millisecond), n, limit)
	}
}

// TestReadyChecksRefusingDatabaseOncePerSecond: while the database
// refuses new connections, Ready in a tight loop, as an unauthenticated
// /readyz can be asked, tries to connect about once a second, not once a
// call: each try can be a failed login that the server logs or counts
// against the role. Found by review: a failed check was not reused, so
// every call dialled.
func TestReadyChecksRefusingDatabaseOncePerSecond(t *testing.T) {
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(pgtest.ConnString(t))
	if err != nil {
		t.Fatal(err)
	}
	// One address, one try: a check is then one dial (sslmode=prefer, or
	// a host name of two addresses, would make it two or four).
	cfg.ConnConfig.Fallbacks = nil
	var refusing atomic.Bool
	var dials atomic.Int64
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if refusing.Load() {
			dials.Add(1)
			return nil, errors.New("connection refused (test)")
		}
		var d net.Dialer
		return d.DialContext(ctx, network, addr)
	}
	d := readyDispatcher(t, cfg)

	// The listener keeps its connection; the pool's are closed, so that
	// a ping needs a new one.
	refusing.Store(true)
	d.pool.Load().Reset()
	eventually(t, "Ready failing once the last success is a second old", func() bool { return d.Ready(ctx) != nil })
	// Asked every millisecond for 2.5 s.
	before, start := dials.Load(), time.Now()
	calls, passed := 0, 0
	for time.Since(start) < 2500*time.Millisecond {
		calls++
		if d.Ready(ctx) == nil {
			passed++
		}
		time.Sleep(time.Millisecond)
	}
	took, n := time.Since(start), dials.Load()-before
	if passed != 0 {
		t.Fatalf("Ready passed %d times of %d while every connection was refused", passed, calls)
	}
	// A check a second, plus one for a second that had begun, each one
	// dial (a refused dial is not a connection lost, which is pinged
	// again); the rest of the allowance is for the reclaim's retries,
	// which dial too, backing off from half a second. Every call dialled
	// before.
	if limit := 4 * (int64(took/time.Second) + 2); n > limit {
		t.Errorf("%d calls of Ready in %s tried %d connections, want at most %d", calls, took.Round(time.Millisecond), n, limit)
	}
	refusing.Store(false)
	eventually(t, "the dispatcher ready again", func() bool { return d.Ready(ctx) == nil })
}

// readyDispatcher runs a dispatcher on cfg that serves no consumer and
// polls hourly, until the test ends, and waits until it is ready.
func readyDispatcher(t *testing.T, cfg *pgxpool.Config) *Dispatcher {
	t.Helper()
	d, err := NewDispatcher(cfg, DispatcherConfig{Resolver: resolverFunc(func(Consumer) Handler { return nil }),
		PollInterval: time.Hour, Logger: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	runUntilCleanup(t, d, nil)
	eventually(t, "the dispatcher ready", func() bool { return d.Ready(context.Background()) == nil })
	return d
}
