package bellhop_test

import (
	"context"
	"testing"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgtest"
)

// BenchmarkEnqueue measures a producer's calls, one after another on one
// connection, with no dispatcher: "one" is Enqueue, one message per
// transaction; "tx of 10" is ten EnqueueTx calls and the commit, per op.
// It uses the public API only, so that it runs unchanged on older commits
// (BENCHMARKS.md, "Enqueue order in one transaction (0065)").
func BenchmarkEnqueue(b *testing.B) {
	ctx := context.Background()
	pool := pgtest.NewPool(b)
	client := bellhop.NewClient(pool)
	if _, err := client.CreateApp(ctx, "app"); err != nil {
		b.Fatal(err)
	}
	payload := []byte(`{"order_id":42}`)
	b.Run("one", func(b *testing.B) {
		for range b.N {
			if _, err := client.Enqueue(ctx, "app", "a", payload, bellhop.EnqueueOptions{}); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("tx of 10", func(b *testing.B) {
		for range b.N {
			tx, err := pool.Begin(ctx)
			if err != nil {
				b.Fatal(err)
			}
			for range 10 {
				if _, err := client.EnqueueTx(ctx, tx, "app", "b", payload, bellhop.EnqueueOptions{}); err != nil {
					b.Fatal(err)
				}
			}
			if err := tx.Commit(ctx); err != nil {
				b.Fatal(err)
			}
		}
	})
}
