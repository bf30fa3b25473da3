package bellhop_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
)

// TestRefusedClaimsNotOnePerMessage: while the server refuses every claim
// with an error of its own (here a trigger's exception; in the lifecycle
// review, UPDATE revoked from the dispatcher's role), a stream of
// messages does not cost one failed claim each: a lane whose claim was
// refused twice in a row claims again at most once a second for the
// notifications that come meanwhile, and on its backoff's timer. It claimed once per
// notification (870 failed claims in 20 s at 50 messages a second, each
// statement logged by the server). Once the cause is mended, the next
// message's notification brings everything.
func TestRefusedClaimsNotOnePerMessage(t *testing.T) {
	e := fxNew(t)
	e.appConsumer("shop", "orders")
	for _, q := range []string{
		`CREATE FUNCTION refuse_claims() RETURNS trigger LANGUAGE plpgsql AS $$
		 BEGIN RAISE EXCEPTION 'claims refused by the test'; END $$`,
		`CREATE TRIGGER refuse_claims BEFORE UPDATE ON queue_messages FOR EACH ROW
		 WHEN (OLD.claim_token IS NULL AND NEW.claim_token IS NOT NULL) EXECUTE FUNCTION refuse_claims()`,
	} {
		if _, err := e.pool.Exec(e.ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	var mu sync.Mutex
	delivered := map[uuid.UUID]bool{}
	mux := bellhop.NewMux()
	mux.Handle("shop", "orders", bellhop.HandlerFunc(func(_ context.Context, m *bellhop.Message) error {
		mu.Lock()
		delivered[m.ID] = true
		mu.Unlock()
		return nil
	}))
	cfg, err := pgxpool.ParseConfig(e.pool.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	claims := &statementTimes{}
	cfg.ConnConfig.Tracer = claims
	runDispatcherOn(t, cfg, mux, func(dc *bellhop.DispatcherConfig) {
		// The claims fail, as they should: not the test's failure.
		dc.Logger = zerolog.Nop()
	})

	const n, every = 60, 20 * time.Millisecond
	var ids []uuid.UUID
	start := time.Now()
	for range n {
		id, err := e.client.Enqueue(e.ctx, "shop", "orders", []byte(`{}`), bellhop.EnqueueOptions{})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
		time.Sleep(every) // the producer's pace, not a synchronisation
	}
	took := time.Since(start)
	// Two for its start (the hold begins with the second refusal in a
	// row), then a claim per second of the stream and one for the
	// backoff's timer in each second, and one to spare.
	if got, most := claims.claims.Load(), 2*int64(took/time.Second)+4; got > most {
		t.Errorf("%d claims, all refused, for %d messages in %s: want at most %d", got, n, took.Round(time.Millisecond), most)
	}
	if _, err := e.pool.Exec(e.ctx, `DROP TRIGGER refuse_claims ON queue_messages`); err != nil {
		t.Fatal(err)
	}
	id, err := e.client.Enqueue(e.ctx, "shop", "orders", []byte(`{}`), bellhop.EnqueueOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ids = append(ids, id)
	waitUntil(t, 5*time.Second, "every message delivered once the claims are allowed", func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, id := range ids {
			if !delivered[id] {
				return false
			}
		}
		return true
	})
}
