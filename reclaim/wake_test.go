package reclaim_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/claim"
	"github.com/bellhopq/bellhop/internal/pgtest"
	"github.com/bellhopq/bellhop/reclaim"
)

// TestReclaimWakesReleasedQueues: a pass that releases expired leases
// notifies "bellhop" once for each queue, and each consumer's invoke
// deliveries, that it released a lease of ("q:<app>:<queue>",
// "o:<app>:<consumer>"), so that any dispatcher, not only this one, claims
// the messages again at once instead of at its next poll.
func TestReclaimWakesReleasedQueues(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool := pgtest.NewPool(t)
	c := bellhop.NewClient(pool)
	app, err := c.CreateApp(ctx, "app")
	if err != nil {
		t.Fatal(err)
	}
	cons, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: "hooks"})
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if _, err := c.Enqueue(ctx, "app", "orders", []byte(`{}`), bellhop.EnqueueOptions{MaxAttempts: 5}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.InvokeAsync(ctx, cons.ID, []byte(`{}`), bellhop.EnqueueOptions{MaxAttempts: 5}); err != nil {
		t.Fatal(err)
	}
	for _, target := range []claim.Target{
		{Source: claim.Queue, AppID: app.ID, Queue: "orders"},
		{Source: claim.Invoke, AppID: app.ID, TriggerID: cons.ID},
	} {
		if msgs, _, err := claim.Claim(ctx, pool, target, 10); err != nil || len(msgs) == 0 {
			t.Fatalf("claim %s: %d messages, %v", target, len(msgs), err)
		}
	}
	expire(t, pool)

	listener, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig.Copy())
	if err != nil {
		t.Fatal(err)
	}
	defer listener.Close(context.Background())
	if _, err := listener.Exec(ctx, "LISTEN bellhop"); err != nil {
		t.Fatal(err)
	}
	r := reclaim.New(pool, zerolog.Nop(), reclaim.Options{DefaultVT: 30 * time.Second})
	if _, err := r.Pass(ctx); err != nil {
		t.Fatal(err)
	}
	if n := countUnclaimed(t, pool); n != 3 {
		t.Fatalf("the pass released %d leases, want 3", n)
	}
	// Everything the pass sent arrives before a notification sent after it.
	const sentinel = "h:sentinel"
	if _, err := pool.Exec(ctx, `SELECT pg_notify('bellhop', $1)`, sentinel); err != nil {
		t.Fatal(err)
	}
	var got []string
	for {
		n, err := listener.WaitForNotification(ctx)
		if err != nil {
			t.Fatalf("wait for notifications (got %q): %v", got, err)
		}
		if n.Payload == sentinel {
			break
		}
		got = append(got, n.Payload)
	}
	slices.Sort(got)
	want := []string{"o:" + app.ID.String() + ":" + cons.ID.String(), "q:" + app.ID.String() + ":orders"}
	if !slices.Equal(got, want) {
		t.Errorf("the reclaim pass notified %q, want %q", got, want)
	}
}

// countUnclaimed counts the messages and invoke deliveries that hold no
// lease.
func countUnclaimed(t *testing.T, pool *pgxpool.Pool) int64 {
	t.Helper()
	var n int64
	if err := pool.QueryRow(context.Background(), `SELECT (SELECT count(*) FROM queue_messages WHERE claim_token IS NULL)
		+ (SELECT count(*) FROM outbox WHERE claim_token IS NULL)`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}
