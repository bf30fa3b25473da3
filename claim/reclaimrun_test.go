package claim_test

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/claim"
	"github.com/bellhopq/bellhop/reclaim"
	queries "github.com/bellhopq/bellhop/sql"
)

// passClock records when each reclaim pass started and ended, as a pool
// tracer.
type passClock struct {
	mu     sync.Mutex
	starts []time.Time
	ends   []time.Time
	failed int // passes that ended with an error
}

func (p *passClock) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (p *passClock) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (p *passClock) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	for _, q := range d.Batch.QueuedQueries {
		if q.SQL == queries.Reclaim {
			p.mu.Lock()
			p.starts = append(p.starts, time.Now())
			p.mu.Unlock()
		}
	}
	return ctx
}

func (p *passClock) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (p *passClock) TraceBatchEnd(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchEndData) {
	// Every batch of the reclaimer's pool is a pass.
	p.mu.Lock()
	p.ends = append(p.ends, time.Now())
	if d.Err != nil {
		p.failed++
	}
	p.mu.Unlock()
}

// waitPasses waits for n passes and returns their start times.
func (p *passClock) waitPasses(t *testing.T, n int, within time.Duration) []time.Time {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		p.mu.Lock()
		starts := append([]time.Time(nil), p.starts...)
		p.mu.Unlock()
		if len(starts) >= n {
			return starts
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d reclaim passes in %s, want %d", len(starts), within, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// runReclaimer runs a reclaimer on a pool of pool's database whose
// passes clock records, from now until the test ends. DefaultVT is 5s
// unless opts sets it.
func runReclaimer(t *testing.T, pool *pgxpool.Pool, opts reclaim.Options) *passClock {
	t.Helper()
	clock := &passClock{}
	cfg := pool.Config()
	cfg.ConnConfig.Tracer = clock
	traced, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if opts.DefaultVT == 0 {
		opts.DefaultVT = 5 * time.Second
	}
	r := reclaim.New(traced, zerolog.Nop(), opts)
	done := make(chan struct{})
	go func() {
		defer close(done)
		r.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		traced.Close()
	})
	r.Observe(time.Now())
	return clock
}

// TestReclaimFailureBacksOff: a reclaim pass that keeps failing is retried
// at 1, 2, 4 ... 30s (each with jitter down to half), not every second for
// as long as the failure lasts, which cost a statement and a warning a
// second per dispatcher.
func TestReclaimFailureBacksOff(t *testing.T) {
	t.Parallel()
	pool, _, _ := setup(t)
	if _, err := pool.Exec(context.Background(), `ALTER FUNCTION bellhop_start_seen_vt_floors() RENAME TO broken`); err != nil {
		t.Fatal(err)
	}
	starts := runReclaimer(t, pool, reclaim.Options{}).waitPasses(t, 4, 20*time.Second)
	// The third retry waits 2 to 4s; every retry waited 1s.
	if gap := starts[3].Sub(starts[2]); gap < 1800*time.Millisecond {
		t.Errorf("the third retry of a failing reclaim pass came %s after the second: not backing off", gap.Round(time.Millisecond))
	}
}

// TestReclaimLockedLeaseBacksOff: an expired lease on a row another
// transaction holds locked, which the pass skips, is looked at again
// backing off to once a second: it was looked at ten times a second for
// as long as the lock lasted. Once the lock goes, it is reclaimed.
func TestReclaimLockedLeaseBacksOff(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, c, appID := setup(t)
	id, err := c.Enqueue(ctx, "app", "q", []byte(`1`), bellhop.EnqueueOptions{})
	if err != nil {
		t.Fatal(err)
	}
	claimOne(t, pool, claim.Target{Source: claim.Queue, AppID: appID, Queue: "q"}, id)
	if _, err := pool.Exec(ctx, `UPDATE queue_messages SET claimed_at = now() - interval '1 hour' WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT 1 FROM queue_messages WHERE id = $1 FOR UPDATE`, id); err != nil {
		t.Fatal(err)
	}
	var released atomic.Int64
	clock := runReclaimer(t, pool, reclaim.Options{OnPass: func(res reclaim.Result) { released.Add(res.Released) }})
	// Six passes: 0.5s at 100ms apart; 200, 400, 800ms, then 1s apart.
	starts := clock.waitPasses(t, 6, 20*time.Second)
	if d := starts[5].Sub(starts[0]); d < 1500*time.Millisecond {
		t.Errorf("six reclaim passes over a locked expired lease in %s: not backing off", d.Round(time.Millisecond))
	}
	if released.Load() != 0 {
		t.Fatal("a lease on a locked row was reclaimed")
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for released.Load() != 1 {
		if time.Now().After(deadline) {
			t.Fatal("the lease was not reclaimed within 10s of its row's lock ending")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// expiredLeases enqueues n messages to app's queue q, claims them, and
// backdates their leases by an hour.
func expiredLeases(t *testing.T, pool *pgxpool.Pool, c *bellhop.Client, appID uuid.UUID, n int) {
	t.Helper()
	ctx := context.Background()
	for i := range n {
		if _, err := c.Enqueue(ctx, "app", "q", []byte(strconv.Itoa(i)), bellhop.EnqueueOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	msgs, _, err := claim.Claim(ctx, pool, claim.Target{Source: claim.Queue, AppID: appID, Queue: "q"}, n)
	if err != nil || len(msgs) != n {
		t.Fatalf("claimed %d of %d: %v", len(msgs), n, err)
	}
	if _, err := pool.Exec(ctx, `UPDATE queue_messages SET claimed_at = now() - interval '1 hour' WHERE claim_token IS NOT NULL`); err != nil {
		t.Fatal(err)
	}
}

// TestReclaimInBatches: a pass returns at most a batch of expired leases;
// Pass, and the running reclaimer, go on until none is left.
func TestReclaimInBatches(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, c, appID := setup(t)
	expiredLeases(t, pool, c, appID, 25)
	var passes []int64
	r := reclaim.New(pool, zerolog.Nop(), reclaim.Options{DefaultVT: 5 * time.Second, Batch: 10,
		OnPass: func(res reclaim.Result) { passes = append(passes, res.Released) }})
	if _, err := r.Pass(ctx); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(passes, []int64{10, 10, 5}) {
		t.Errorf("passes released %v, want [10 10 5]", passes)
	}
	var unclaimed int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM queue_messages WHERE claim_token IS NULL`).Scan(&unclaimed); err != nil {
		t.Fatal(err)
	}
	if unclaimed != 25 {
		t.Errorf("%d of 25 released", unclaimed)
	}

	expiredLeases(t, pool, c, appID, 25)
	var released atomic.Int64
	clock := runReclaimer(t, pool, reclaim.Options{Batch: 10, OnPass: func(res reclaim.Result) { released.Add(res.Released) }})
	clock.waitPasses(t, 3, 10*time.Second)
	deadline := time.Now().Add(10 * time.Second)
	for released.Load() != 25 {
		if time.Now().After(deadline) {
			t.Fatalf("the running reclaimer released %d of 25 within 10s", released.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
	// That a pass that filled its batch is followed at once, not when the
	// timer would start one, reclaim's TestFullBatchFollowedAtOnce shows
	// with the timer's least wait lengthened: here its 100 ms would be
	// told from "at once" by a margin a loaded machine can blur.
}

// TestReclaimDefaultBatch: with no Batch set, a pass returns at most
// 10,000 expired leases (reclaim.DefaultBatch, as guarantees.md states),
// and Pass goes on until none is left.
func TestReclaimDefaultBatch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _, appID := setup(t)
	const documented = 10_000
	if _, err := pool.Exec(ctx, `INSERT INTO queue_messages (app_id, queue_name, payload, claim_token, claimed_at, attempt)
		SELECT $1, 'q', '{}', gen_random_uuid(), now() - interval '1 hour', 1 FROM generate_series(1, $2)`,
		appID, documented+1); err != nil {
		t.Fatal(err)
	}
	var passes []int64
	r := reclaim.New(pool, zerolog.Nop(), reclaim.Options{DefaultVT: 5 * time.Second,
		OnPass: func(res reclaim.Result) { passes = append(passes, res.Released) }})
	if _, err := r.Pass(ctx); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(passes, []int64{documented, 1}) {
		t.Errorf("passes released %v, want [%d 1]", passes, documented)
	}
}

// TestReclaimReportsNextExpiry: Pass reports when the next live lease
// ends, on this process's clock (claim.LocalClock, which TestLocalClock
// tests with the clocks apart), and zero once nothing is in flight.
func TestReclaimReportsNextExpiry(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _, appID := setup(t)
	r := reclaim.New(pool, zerolog.Nop(), reclaim.Options{DefaultVT: 5 * time.Second})
	next, err := r.Pass(ctx)
	if err != nil || !next.IsZero() {
		t.Fatalf("Pass with nothing in flight = %v, %v; want the zero time", next, err)
	}
	before := time.Now()
	if _, err := pool.Exec(ctx, `INSERT INTO queue_messages (app_id, queue_name, payload, claim_token, claimed_at, attempt)
		VALUES ($1, 'q', '{}', gen_random_uuid(), now() - interval '1 second', 1)`, appID); err != nil {
		t.Fatal(err)
	}
	next, err = r.Pass(ctx)
	after := time.Now()
	if err != nil {
		t.Fatal(err)
	}
	// Claimed 1s before the INSERT began, under the 5s default: it ends
	// 4s after that, which was between before and after.
	if next.Before(before.Add(4*time.Second)) || next.After(after.Add(4*time.Second)) {
		t.Errorf("next expiry %s after the INSERT began, want 4s (INSERT and Pass took %s)", next.Sub(before), after.Sub(before))
	}
}

// TestReclaimPassTimesOut: a pass that has not answered within the
// reclaimer's timeout (here it waits for a table lock) is cancelled, and
// says so, rather than holding the reclaimer for as long as the wait
// lasts; the next pass, once the lock is gone, reclaims.
func TestReclaimPassTimesOut(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, c, appID := setup(t)
	expiredLeases(t, pool, c, appID, 1)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `LOCK TABLE queue_messages IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	var released atomic.Int64
	r := reclaim.New(pool, zerolog.Nop(), reclaim.Options{DefaultVT: 5 * time.Second, Timeout: 200 * time.Millisecond,
		OnPass: func(res reclaim.Result) { released.Add(res.Released) }})
	failed := make(chan error, 1)
	go func() {
		_, err := r.Pass(ctx)
		failed <- err
	}()
	select {
	case err := <-failed:
		if err == nil || !strings.Contains(err.Error(), "no answer within 200ms") {
			t.Errorf("Pass behind a lock = %v, want a timeout that says so", err)
		}
	case <-time.After(5 * time.Second):
		t.Error("Pass behind a lock did not return within 5s; its timeout is 200ms")
	}
	// The cancelled pass ends on the server when its cancel request lands,
	// which can be after Pass returned: were the lock gone first, that
	// pass would reclaim the lease and never report it.
	waitFor(t, "the cancelled pass to stop waiting for the lock", func() bool { return lockWaiters(t, pool) == 0 })
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Pass(ctx); err != nil {
		t.Fatal(err)
	}
	if n := released.Load(); n != 1 {
		t.Errorf("released %d after the lock, want 1", n)
	}
}

// TestReclaimTimeoutGrows: a pass that takes longer than the reclaimer's
// timeout every time (here each pass sleeps 300ms; in real life, many
// leases older than the shortest timeout, which a pass reads) is tried
// again with twice the timeout, until it fits: with a fixed timeout, no
// pass would ever answer and no lease would come back.
//
// The test waits for a pass that answered, not for the release to be
// reported: a pass cut off by its timeout is cancelled on the server by
// a cancel request that, on a loaded machine, can land after the pass
// committed, and then its release is done but never reported.
func TestReclaimTimeoutGrows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, c, appID := setup(t)
	expiredLeases(t, pool, c, appID, 1)
	if _, err := pool.Exec(ctx, `ALTER FUNCTION bellhop_start_seen_vt_floors() RENAME TO quick_floors;
		CREATE FUNCTION bellhop_start_seen_vt_floors() RETURNS bigint LANGUAGE sql
		AS $$ SELECT pg_sleep(0.3); SELECT quick_floors() $$`); err != nil {
		t.Fatal(err)
	}
	clock := runReclaimer(t, pool, reclaim.Options{Timeout: 100 * time.Millisecond})
	// 100 and 200ms run out; 400ms fits, or 800ms on a loaded machine.
	// Retries wait 0.5 – 1s, then 1 – 2s, 2 – 4s, 4 – 8s.
	deadline := time.Now().Add(30 * time.Second)
	for {
		clock.mu.Lock()
		passes, failed := len(clock.ends), clock.failed
		clock.mu.Unlock()
		if passes > failed {
			if failed < 2 {
				t.Fatalf("%d passes failed before one answered, want at least 2 (100 and 200ms cannot fit a 300ms pass)", failed)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no pass answered within 30s (%d failed): the timeout did not grow", failed)
		}
		time.Sleep(10 * time.Millisecond)
	}
	var held bool
	if err := pool.QueryRow(ctx, `SELECT claim_token IS NOT NULL FROM queue_messages`).Scan(&held); err != nil {
		t.Fatal(err)
	}
	if held {
		t.Fatal("a pass answered and the expired lease is still held")
	}
}
