package bellhop

import (
	"context"
	"sync"
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
	d, err := NewDispatcher(cfg, DispatcherConfig{Resolver: resolverFunc(func(Consumer) Handler { return nil }),
		PollInterval: time.Hour, Logger: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	runUntilCleanup(t, d, nil)
	eventually(t, "the dispatcher ready", func() bool { return d.Ready(ctx) == nil })

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
