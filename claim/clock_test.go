package claim_test

import (
	"context"
	"testing"
	"time"

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
