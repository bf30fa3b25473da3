package claim_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/claim"
)

// TestLocalClock: a database time is moved onto this process's clock by
// the database's own clock read beside it, whichever way the two differ:
// a timer armed on the raw time fired as late as the database was ahead
// (every delayed message, retry and reclaim), or early and then spun.
func TestLocalClock(t *testing.T) {
	for _, skew := range []time.Duration{-time.Hour, -3 * time.Second, 0, 3 * time.Second, time.Hour} {
		before := time.Now()
		dbNow := before.Add(skew)
		got := claim.LocalClock(dbNow)(dbNow.Add(2 * time.Second))
		after := time.Now()
		if got.Before(before.Add(2*time.Second)) || got.After(after.Add(2*time.Second)) {
			t.Errorf("database %s ahead: a time 2s after its now became %s from ours, want 2s", skew, got.Sub(before))
		}
	}
}

// TestNextDueOnLocalClock: a claim pass reports a delayed message's due
// time on this process's clock.
func TestNextDueOnLocalClock(t *testing.T) {
	ctx := context.Background()
	pool, c, appID := setup(t)
	if _, err := c.Enqueue(ctx, "app", "q", []byte(`1`), bellhop.EnqueueOptions{Delay: 3 * time.Second}); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	p, err := claim.ClaimPass(ctx, pool, claim.Target{Source: claim.Queue, AppID: appID, Queue: "q"}, 10, claim.Busy{})
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Messages) != 0 {
		t.Fatalf("claimed %d messages not yet due", len(p.Messages))
	}
	if in := p.NextDue.Sub(start); in < 2*time.Second || in > 3*time.Second+500*time.Millisecond {
		t.Errorf("next due in %s, want about 3s", in)
	}
}

// TestLeasedAtAfterPoolWait: a claim's leases are measured (LeasedAt) from
// once its connection was acquired, not from before a wait for a busy
// pool's connection, and never from after the database took them
// (claimed_at): a wait that long no longer eats into the handler's time,
// and the lease still ends on our clock no later than the reclaimer
// thinks. Fails with LeasedAt read before the acquire.
func TestLeasedAtAfterPoolWait(t *testing.T) {
	const wait = 300 * time.Millisecond
	for _, source := range []claim.Source{claim.Queue, claim.Invoke} {
		t.Run(source.String(), func(t *testing.T) {
			ctx := context.Background()
			pool, client, appID := setup(t)
			id, table, target := newMessage(t, client, appID, source, "q")
			cfg := pool.Config()
			cfg.MaxConns = 1
			acquiring := &acquireTracer{started: make(chan struct{}, 2)}
			cfg.ConnConfig.Tracer = acquiring
			one, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(one.Close)
			held, err := one.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			<-acquiring.started // the test's own
			type result struct {
				msgs []claim.Message
				err  error
			}
			done := make(chan result, 1)
			go func() {
				msgs, _, err := claim.Claim(ctx, one, target, 10)
				done <- result{msgs, err}
			}()
			<-acquiring.started // the claim waits for the connection
			time.Sleep(wait)    // the wait being measured, not a synchronisation
			freed := time.Now()
			held.Release()
			r := <-done
			if r.err != nil {
				t.Fatal(r.err)
			}
			if len(r.msgs) != 1 || r.msgs[0].ID != id {
				t.Fatalf("claimed %d messages, want %s", len(r.msgs), id)
			}
			m := r.msgs[0]
			if m.LeasedAt.Before(freed) {
				t.Errorf("lease measured from %v before the claim had a connection; the wait for it was counted", freed.Sub(m.LeasedAt))
			}
			var claimedAt time.Time
			if err := pool.QueryRow(ctx, `SELECT claimed_at FROM `+table+` WHERE id = $1`, id).Scan(&claimedAt); err != nil {
				t.Fatal(err)
			}
			if m.LeasedAt.After(claimedAt) {
				t.Errorf("lease measured from %v after the database took it", m.LeasedAt.Sub(claimedAt))
			}
		})
	}
}

// acquireTracer signals each start of a pool's Acquire.
type acquireTracer struct{ started chan struct{} }

func (a *acquireTracer) TraceAcquireStart(ctx context.Context, _ *pgxpool.Pool, _ pgxpool.TraceAcquireStartData) context.Context {
	a.started <- struct{}{}
	return ctx
}

func (a *acquireTracer) TraceAcquireEnd(context.Context, *pgxpool.Pool, pgxpool.TraceAcquireEndData) {
}

func (a *acquireTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (a *acquireTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
