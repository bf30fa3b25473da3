package claim_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop/claim"
	"github.com/bellhopq/bellhop/reclaim"
)

// TestReclaimLeavesOtherOutboxRows: the outbox is shared with the base
// system, whose own dispatcher leases its 'event' and 'cron' rows. The
// reclaimer neither releases nor dead-letters them, however old their
// lease, and they do not set its timer; the 'invoke' delivery beside them
// is reclaimed as usual.
func TestReclaimLeavesOtherOutboxRows(t *testing.T) {
	ctx := context.Background()
	pool, client, appID := setup(t)
	var trigger uuid.UUID
	if err := pool.QueryRow(ctx, `
		WITH p AS (INSERT INTO principals (app_id, name) VALUES ($1, 'base') RETURNING id)
		INSERT INTO triggers (app_id, kind, principal_id) SELECT $1, 'http', id FROM p RETURNING id`,
		appID).Scan(&trigger); err != nil {
		t.Fatal(err)
	}
	foreign := map[string]uuid.UUID{}
	for kind, attempt := range map[string]int{"event": 1, "cron": 3} { // cron: its last attempt
		var id uuid.UUID
		if err := pool.QueryRow(ctx, `
			INSERT INTO outbox (app_id, source_kind, trigger_id, payload, claim_token, claimed_at, attempt, max_attempts)
			VALUES ($1, $2, $3, '{}', gen_random_uuid(), now() - interval '1 day', $4, 3) RETURNING id`,
			appID, kind, trigger, attempt).Scan(&id); err != nil {
			t.Fatal(err)
		}
		foreign[kind] = id
	}
	before := map[string]string{}
	for kind, id := range foreign {
		before[kind] = snapshot(t, pool, "outbox", id)
	}

	r := reclaim.New(pool, zerolog.Nop(), reclaim.Options{DefaultVT: 30 * time.Second})
	var next *time.Time
	if err := pool.QueryRow(ctx, `SELECT bellhop_next_lease_expiry(30)`).Scan(&next); err != nil {
		t.Fatal(err)
	}
	if next != nil {
		t.Errorf("next lease expiry %v with only the base system's leases out, want none", next)
	}

	// Bellhop's own expired lease beside them is reclaimed.
	id, _, target := newMessage(t, client, appID, claim.Invoke, "mine")
	claimOne(t, pool, target, id)
	if _, err := pool.Exec(ctx, `UPDATE outbox SET claimed_at = now() - interval '1 day' WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Pass(ctx); err != nil {
		t.Fatal(err)
	}
	var token *uuid.UUID
	if err := pool.QueryRow(ctx, `SELECT claim_token FROM outbox WHERE id = $1`, id).Scan(&token); err != nil {
		t.Fatal(err)
	}
	if token != nil {
		t.Error("the expired invoke delivery was not reclaimed")
	}
	for kind, id := range foreign {
		if after := snapshot(t, pool, "outbox", id); after != before[kind] {
			t.Errorf("the reclaimer changed a leased %q row:\nbefore %s\nafter  %s", kind, before[kind], after)
		}
		if deadLetterCount(t, pool, id) != 0 {
			t.Errorf("the reclaimer dead-lettered a leased %q row", kind)
		}
	}
}
