package claim_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/claim"
)

// TestClaimTakesOnlyReadyUnleased: a claim leases at most its max of a
// target's ready messages, the oldest enqueued_at first, and never one
// that is leased or not yet due: with three ready and one delayed, a claim
// of 2 gets the two oldest, the next claim the third, and a third claim
// nothing. Each claim statement: one queue (claim_queue.sql), several
// queues (claim_queues.sql), a consumer's invoke deliveries
// (claim_invoke.sql). The messages' enqueued_at runs opposite to the
// order they were written in, and the claims run once as the server
// plans them and once with index scans off: the order is the documented
// one whatever the plan, not the order an index happens to return.
func TestClaimTakesOnlyReadyUnleased(t *testing.T) {
	for _, plan := range []string{"any plan", "no index scan"} {
		for _, kind := range []string{"queue", "queues", "invoke"} {
			t.Run(plan+"/"+kind, func(t *testing.T) {
				ctx := context.Background()
				pool, c, appID := setup(t)
				if plan == "no index scan" {
					cfg := pool.Config()
					cfg.ConnConfig.RuntimeParams["enable_indexscan"] = "off"
					cfg.ConnConfig.RuntimeParams["enable_indexonlyscan"] = "off"
					p, err := pgxpool.NewWithConfig(ctx, cfg)
					if err != nil {
						t.Fatal(err)
					}
					t.Cleanup(p.Close)
					pool = p
				}
				cons, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: "q"})
				if err != nil {
					t.Fatal(err)
				}
				table := "queue_messages"
				target := claim.Target{Source: claim.Queue, AppID: appID, Queue: "q", TriggerID: cons.ID}
				add := func(opts bellhop.EnqueueOptions) uuid.UUID {
					id, err := c.Enqueue(ctx, "app", "q", []byte(`{}`), opts)
					if err != nil {
						t.Fatal(err)
					}
					return id
				}
				if kind == "invoke" {
					table = "outbox"
					target = claim.Target{Source: claim.Invoke, AppID: appID, TriggerID: cons.ID}
					add = func(opts bellhop.EnqueueOptions) uuid.UUID {
						id, err := c.InvokeAsync(ctx, cons.ID, []byte(`{}`), opts)
						if err != nil {
							t.Fatal(err)
						}
						return id
					}
				}
				var ready []uuid.UUID // oldest first
				for range 3 {
					ready = slices.Insert(ready, 0, add(bellhop.EnqueueOptions{}))
				}
				delayed := add(bellhop.EnqueueOptions{Delay: time.Hour})
				// The last written is the oldest; the delayed message the
				// oldest of all.
				if _, err := pool.Exec(ctx, `UPDATE `+table+` SET enqueued_at = now() - interval '1 hour' * (4 - array_position($1::uuid[], id))
					WHERE id = ANY ($1::uuid[])`, append([]uuid.UUID{delayed}, ready...)); err != nil {
					t.Fatal(err)
				}

				claimN := func(max int) []uuid.UUID {
					t.Helper()
					var msgs []claim.Message
					if kind == "queues" {
						other := claim.Target{Source: claim.Queue, AppID: appID, Queue: "other"}
						ps, err := claim.ClaimPasses(ctx, pool, []claim.Request{{Target: target, Max: max}, {Target: other, Max: max}})
						if err != nil {
							t.Fatal(err)
						}
						msgs = ps[0].Messages
					} else {
						var err error
						if msgs, _, err = claim.Claim(ctx, pool, target, max); err != nil {
							t.Fatal(err)
						}
					}
					return messageIDs(msgs)
				}
				for i, step := range []struct {
					max  int
					want []uuid.UUID
				}{
					{2, ready[:2]},
					{10, ready[2:]},
					{10, nil},
				} {
					if got := claimN(step.max); !slices.Equal(got, step.want) {
						t.Errorf("claim %d (max %d) leased %v, want %v (ready, oldest first: %v; delayed: %s)",
							i+1, step.max, got, step.want, ready, delayed)
					}
				}
			})
		}
	}
}
