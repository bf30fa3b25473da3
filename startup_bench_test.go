package bellhop_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgtest"
)

// BenchmarkStartup measures a dispatcher's start: from Run to the first
// handler call, with five messages waiting in the one queue of the one
// consumer, on a fresh database each time (made outside the timing). Its
// time per op is that wait. It uses the public API only, so that it runs
// unchanged on older commits (BENCHMARKS.md, "Start-up").
func BenchmarkStartup(b *testing.B) {
	ctx := context.Background()
	for range b.N {
		b.StopTimer()
		cfg, err := pgxpool.ParseConfig(pgtest.ConnString(b))
		if err != nil {
			b.Fatal(err)
		}
		pool, err := pgxpool.NewWithConfig(ctx, cfg.Copy())
		if err != nil {
			b.Fatal(err)
		}
		client := bellhop.NewClient(pool)
		if _, err := client.CreateApp(ctx, "app"); err != nil {
			b.Fatal(err)
		}
		if _, err := client.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: "a", MaxInFlight: 10}); err != nil {
			b.Fatal(err)
		}
		for range 5 {
			if _, err := client.Enqueue(ctx, "app", "a", []byte(`{}`), bellhop.EnqueueOptions{}); err != nil {
				b.Fatal(err)
			}
		}
		pool.Close()
		first := make(chan struct{}, 1)
		mux := bellhop.NewMux()
		handled := false
		mux.Handle("app", "a", bellhop.HandlerFunc(func(context.Context, *bellhop.Message) error {
			select {
			case first <- struct{}{}:
			default:
			}
			return nil
		}))
		d, err := bellhop.NewDispatcher(cfg, bellhop.DispatcherConfig{Resolver: mux, Logger: zerolog.Nop()})
		if err != nil {
			b.Fatal(err)
		}
		rctx, cancel := context.WithCancel(ctx)
		ran := make(chan error, 1)
		b.StartTimer()
		go func() { ran <- d.Run(rctx) }()
		select {
		case <-first:
			handled = true
		case <-time.After(30 * time.Second):
		}
		b.StopTimer()
		cancel()
		if err := <-ran; err != nil {
			b.Fatal(err)
		}
		if !handled {
			b.Fatal("no delivery within 30s of Run")
		}
	}
}
