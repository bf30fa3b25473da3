package bellhop

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/bellhopq/bellhop/claim"
	"github.com/bellhopq/bellhop/internal/pgtest"
)

// TestLeaseEndIncludesRenewal: the lease end that the Completer retries
// an outcome's write until (claim.Message.LeaseEnd) is the one the last
// renewal set, not the claim's. Here the consumer's visibility timeout is
// raised from 10 s to an hour after the claim, and the handler renews:
// its outcome may then be written for an hour, since no other dispatcher
// reclaims the message before. A lease never renewed ends a visibility
// timeout after the claim.
func TestLeaseEndIncludesRenewal(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewPool(t)
	client := NewClient(pool)
	if _, err := client.CreateApp(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	const vt = 10 * time.Second
	con, err := client.RegisterConsumer(ctx, ConsumerSpec{App: "app", Queue: "orders", VisibilityTimeout: vt})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if _, err := client.Enqueue(ctx, "app", "orders", []byte(`{}`), EnqueueOptions{}); err != nil {
			t.Fatalf("enqueue %d: %v", i, err)
		}
	}
	target := claim.Target{Source: claim.Queue, AppID: con.AppID, Queue: "orders", TriggerID: con.ID}
	ms, _, err := claim.Claim(ctx, pool, target, 2)
	if err != nil || len(ms) != 2 {
		t.Fatalf("claimed %d messages, want 2: %v", len(ms), err)
	}
	renewed, kept := &ms[0], &ms[1]
	nop := func(error) {}
	lr, lk := newLease(pool, renewed, vt, nop), newLease(pool, kept, vt, nop)

	longer := time.Hour
	if err := client.UpdateConsumer(ctx, "app", con.ID, ConsumerUpdate{VisibilityTimeout: &longer}); err != nil {
		t.Fatal(err)
	}
	before := time.Now()
	if err := lr.extend(ctx); err != nil {
		t.Fatalf("renew: %v", err)
	}
	after := time.Now()
	lr.stop()
	lk.stop()

	if renewed.LeaseEnd.Before(before.Add(longer)) || renewed.LeaseEnd.After(after.Add(longer)) {
		t.Errorf("renewed lease ends %s after the renewal was sent and %s after it returned, want an hour",
			renewed.LeaseEnd.Sub(before), renewed.LeaseEnd.Sub(after))
	}
	if want := kept.LeasedAt.Add(vt); !kept.LeaseEnd.Equal(want) {
		t.Errorf("lease never renewed ends %s after its claim, want %s", kept.LeaseEnd.Sub(kept.LeasedAt), vt)
	}
	// Once stopped, a renewal (a goroutine the handler left behind)
	// changes nothing.
	end := renewed.LeaseEnd
	if err := lr.extend(ctx); !errors.Is(err, ErrLeaseLost) {
		t.Errorf("renewal after the handler returned: %v, want ErrLeaseLost", err)
	}
	if !renewed.LeaseEnd.Equal(end) {
		t.Errorf("a renewal after the handler returned moved the lease's end by %s", renewed.LeaseEnd.Sub(end))
	}
}
