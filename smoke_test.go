package bellhop_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgtest"
)

func TestSmoke(t *testing.T) {
	ctx := context.Background()
	dsn := pgtest.ConnString(t)
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	c := bellhop.NewClient(pool)
	if _, err := c.CreateApp(ctx, "shop"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders"}); err != nil {
		t.Fatal(err)
	}
	var got atomic.Int32
	mux := bellhop.NewMux()
	mux.Handle("shop", "orders", bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
		got.Add(1)
		return nil
	}))
	cfg, _ := pgxpool.ParseConfig(dsn)
	d, err := bellhop.NewDispatcher(cfg, bellhop.DispatcherConfig{Resolver: mux, Logger: zerolog.New(zerolog.NewTestWriter(t)), PollInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error)
	go func() { done <- d.Run(rctx) }()
	deadline := time.Now().Add(5 * time.Second)
	for d.Ready(ctx) != nil && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	for i := 0; i < 100; i++ {
		if _, err := c.Enqueue(ctx, "shop", "orders", []byte(`{"n":1}`), bellhop.EnqueueOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for got.Load() < 100 && time.Now().Before(deadline.Add(5*time.Second)) {
		time.Sleep(5 * time.Millisecond)
	}
	if got.Load() != 100 {
		t.Fatalf("handled %d", got.Load())
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	var left int
	pool.QueryRow(ctx, "select count(*) from queue_messages").Scan(&left)
	if left != 0 {
		t.Fatalf("%d left", left)
	}
}
