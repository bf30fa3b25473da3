package claim_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/claim"
)

// enqueueN enqueues n messages to app's queue, each with opts, and
// returns their ids in the order they were enqueued.
func enqueueN(t *testing.T, c *bellhop.Client, app, queue string, n int, opts bellhop.EnqueueOptions) []uuid.UUID {
	t.Helper()
	var ids []uuid.UUID
	for i := range n {
		id, err := c.Enqueue(context.Background(), app, queue, []byte(fmt.Sprintf(`{"n":%d}`, i)), opts)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	return ids
}

func messageIDs(ms []claim.Message) []uuid.UUID {
	var ids []uuid.UUID
	for _, m := range ms {
		ids = append(ids, m.ID)
	}
	return ids
}

// TestClaimPasses: a combined pass gives each queue what a pass of its
// own would: its oldest ready messages up to its own limit, its next due
// time, another dispatcher's mark on it, whether ready messages are left,
// and its consumer's visibility timeout; and it sets busy marks only on
// the queues whose requests ask for one.
func TestClaimPasses(t *testing.T) {
	ctx := context.Background()
	pool, c, appID := setup(t)
	other, err := c.CreateApp(ctx, "other")
	if err != nil {
		t.Fatal(err)
	}
	consumers := map[string]uuid.UUID{}
	for _, s := range []bellhop.ConsumerSpec{
		{App: "app", Queue: "a", VisibilityTimeout: 11 * time.Second},
		{App: "app", Queue: "b", VisibilityTimeout: 12 * time.Second},
		{App: "app", Queue: "c", VisibilityTimeout: 13 * time.Second},
		{App: "other", Queue: "a", VisibilityTimeout: 14 * time.Second},
	} {
		cons, err := c.RegisterConsumer(ctx, s)
		if err != nil {
			t.Fatal(err)
		}
		consumers[s.App+"/"+s.Queue] = cons.ID
	}
	a := enqueueN(t, c, "app", "a", 5, bellhop.EnqueueOptions{})
	b := enqueueN(t, c, "app", "b", 2, bellhop.EnqueueOptions{})
	enqueueN(t, c, "app", "b", 1, bellhop.EnqueueOptions{Delay: time.Hour})
	otherA := enqueueN(t, c, "other", "a", 3, bellhop.EnqueueOptions{})
	// Another dispatcher's live mark on app/b only.
	if _, err := pool.Exec(ctx, `INSERT INTO queue_busy (app_id, queue_name, owner, lease_until)
		VALUES ($1, 'b', gen_random_uuid(), clock_timestamp() + interval '1 minute')`, appID); err != nil {
		t.Fatal(err)
	}

	owner := uuid.New()
	busy := claim.Busy{Owner: owner, Lease: time.Minute, Held: true}
	marked := busy
	marked.Mark = true
	target := func(app uuid.UUID, appName, queue string) claim.Target {
		return claim.Target{Source: claim.Queue, AppID: app, Queue: queue, TriggerID: consumers[appName+"/"+queue]}
	}
	start := time.Now()
	ps, err := claim.ClaimPasses(ctx, pool, []claim.Request{
		{Target: target(appID, "app", "a"), Max: 3, Busy: marked},
		{Target: target(appID, "app", "b"), Max: 5, Busy: busy},
		{Target: target(appID, "app", "c"), Max: 2, Busy: busy},
		{Target: target(other.ID, "other", "a"), Max: 1, Busy: busy},
	})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name      string
		pass      claim.Pass
		want      []uuid.UUID
		vt        time.Duration
		readyLeft bool
		due       bool // a next due time about an hour ahead
		foreign   bool
	}{
		{name: "app/a", pass: ps[0], want: a[:3], vt: 11 * time.Second, readyLeft: true},
		{name: "app/b", pass: ps[1], want: b, vt: 12 * time.Second, due: true, foreign: true},
		{name: "app/c", pass: ps[2]},
		{name: "other/a", pass: ps[3], want: otherA[:1], vt: 14 * time.Second, readyLeft: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := tt.pass
			if got := messageIDs(p.Messages); !slices.Equal(got, tt.want) {
				t.Errorf("claimed %v, want %v (oldest first)", got, tt.want)
			}
			for _, m := range p.Messages {
				if m.VisibilityTimeout != tt.vt || m.Attempt != 1 || m.Token == uuid.Nil || m.LeasedAt.Before(start) {
					t.Errorf("message %s: timeout %s (want %s), attempt %d, token %s, leased at %s", m.ID, m.VisibilityTimeout, tt.vt, m.Attempt, m.Token, m.LeasedAt)
				}
			}
			if p.ReadyLeft != tt.readyLeft {
				t.Errorf("ReadyLeft %v, want %v", p.ReadyLeft, tt.readyLeft)
			}
			if in := p.NextDue.Sub(start); tt.due != (in > 59*time.Minute && in < 61*time.Minute) {
				t.Errorf("next due %s from the start, want an hour: %v", in, tt.due)
			}
			if in := p.ForeignLease.Sub(start); tt.foreign != (in > 50*time.Second && in < 70*time.Second) {
				t.Errorf("foreign lease ends %s from the start, want a minute: %v", in, tt.foreign)
			}
		})
	}
	var marks []string
	rows, err := pool.Query(ctx, `SELECT queue_name FROM queue_busy WHERE owner = $1`, owner)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var q string
		if err := rows.Scan(&q); err != nil {
			t.Fatal(err)
		}
		marks = append(marks, q)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(marks, []string{"a"}) {
		t.Errorf("our marks on %v, want on a only", marks)
	}
	// The leases are in the table: a second pass finds only what is left.
	ps, err = claim.ClaimPasses(ctx, pool, []claim.Request{
		{Target: target(appID, "app", "a"), Max: 10, Busy: busy},
		{Target: target(other.ID, "other", "a"), Max: 10, Busy: busy},
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := messageIDs(ps[0].Messages); !slices.Equal(got, a[3:]) {
		t.Errorf("second pass claimed %v of app/a, want %v", got, a[3:])
	}
	if got := messageIDs(ps[1].Messages); !slices.Equal(got, otherA[1:]) {
		t.Errorf("second pass claimed %v of other/a, want %v", got, otherA[1:])
	}
}

// TestClaimPassesRefuses: requests that cannot go in one statement are
// refused before anything is sent.
func TestClaimPassesRefuses(t *testing.T) {
	pool, _, appID := setup(t)
	q := func(name string) claim.Target { return claim.Target{Source: claim.Queue, AppID: appID, Queue: name} }
	owner := uuid.New()
	tests := []struct {
		name string
		reqs []claim.Request
	}{
		{"none", nil},
		{"a queue twice", []claim.Request{{Target: q("a"), Max: 1}, {Target: q("b"), Max: 1}, {Target: q("a"), Max: 1}}},
		{"invoke deliveries", []claim.Request{{Target: q("a"), Max: 1}, {Target: claim.Target{Source: claim.Invoke, TriggerID: uuid.New()}, Max: 1}}},
		{"two owners", []claim.Request{{Target: q("a"), Max: 1, Busy: claim.Busy{Owner: owner}}, {Target: q("b"), Max: 1, Busy: claim.Busy{Owner: uuid.New()}}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := claim.ClaimPasses(context.Background(), pool, tt.reqs); err == nil {
				t.Error("no error")
			}
		})
	}
}

// blockPass starts a claim pass of c for queue "blocker" that waits on a
// row lock until the returned function is called, and returns once it is
// in flight (waiting for the lock).
func blockPass(t *testing.T, pool *pgxpool.Pool, c *claim.Combiner, appID, owner uuid.UUID) (release func() (claim.Pass, error)) {
	t.Helper()
	ctx := context.Background()
	// The pass sets a busy mark, whose upsert waits for this transaction's
	// lock on the mark's row.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO queue_busy (app_id, queue_name, owner, lease_until)
		VALUES ($1, 'blocker', $2, clock_timestamp())`, appID, owner); err != nil {
		t.Fatal(err)
	}
	done := passAsync(ctx, c, claim.Request{Target: claim.Target{Source: claim.Queue, AppID: appID, Queue: "blocker"}, Max: 1,
		Busy: claim.Busy{Owner: owner, Mark: true, Lease: time.Minute}})
	waitFor(t, "the blocking pass waiting for its lock", func() bool { return lockWaiters(t, pool) == 1 })
	return func() (claim.Pass, error) {
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		r := <-done
		return r.p, r.err
	}
}

// lockWaiters counts the sessions of pool's database waiting for a lock.
func lockWaiters(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
		WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// passResult is a Combiner.Pass's answer.
type passResult struct {
	p   claim.Pass
	err error
}

// passAsync calls c.Pass(ctx, r) from a goroutine of its own, and returns
// the channel its answer comes on.
func passAsync(ctx context.Context, c *claim.Combiner, r claim.Request) <-chan passResult {
	ch := make(chan passResult, 1)
	go func() {
		p, err := c.Pass(ctx, r)
		ch <- passResult{p, err}
	}()
	return ch
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestCombinerCombines: with its one pass in flight, a Combiner makes the
// passes that wait meanwhile as one, each caller getting its own queue's
// messages; a queue asked for twice goes in a pass of its own, and a
// caller stopped while it waits gets an empty pass at once and leaves its
// queue's messages unclaimed.
func TestCombinerCombines(t *testing.T) {
	ctx := context.Background()
	pool, c, appID := setup(t)
	queues := []string{"q0", "q1", "q2", "q3", "q4"}
	ids := map[string][]uuid.UUID{}
	for _, q := range append(queues, "stopped") {
		ids[q] = enqueueN(t, c, "app", q, 2, bellhop.EnqueueOptions{})
	}
	owner := uuid.New()
	comb := claim.NewCombiner(pool, 1, time.Minute)
	release := blockPass(t, pool, comb, appID, owner)

	type result struct {
		queue string
		p     claim.Pass
		err   error
	}
	results := make(chan result, len(queues)+2)
	var wg sync.WaitGroup
	call := func(ctx context.Context, queue string) {
		wg.Go(func() {
			p, err := comb.Pass(ctx, claim.Request{Target: claim.Target{Source: claim.Queue, AppID: appID, Queue: queue}, Max: 1,
				Busy: claim.Busy{Owner: owner, Lease: time.Minute}})
			results <- result{queue, p, err}
		})
	}
	for _, q := range queues {
		call(ctx, q)
	}
	call(ctx, "q0") // the same queue again
	stopped, stop := context.WithCancel(ctx)
	call(stopped, "stopped")
	waitFor(t, "all calls waiting", func() bool {
		_, waiting := claim.CombinerCounts(comb)
		return waiting == len(queues)+2
	})
	stop()
	// The stopped caller is answered while the pass in flight still waits
	// for its lock, not when it ends.
	select {
	case r := <-results:
		results <- r // checked with the others below
		if r.queue != "stopped" {
			t.Fatalf("%s answered while the blocking pass was in flight", r.queue)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the stopped caller was not answered while the blocking pass was in flight")
	}
	if _, waiting := claim.CombinerCounts(comb); waiting != len(queues)+1 {
		t.Fatalf("%d calls waiting after the stop, want %d", waiting, len(queues)+1)
	}
	if _, err := release(); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	close(results)
	q0 := 0
	for r := range results {
		if r.err != nil {
			t.Errorf("%s: %v", r.queue, r.err)
			continue
		}
		want := ids[r.queue][:1]
		switch r.queue {
		case "stopped":
			want = nil
		case "q0":
			// Two passes each claim one of q0's, in either order.
			want = ids["q0"][q0 : q0+1]
			if !slices.Equal(messageIDs(r.p.Messages), want) {
				want = ids["q0"][1-q0 : 2-q0]
			}
			q0++
		}
		if got := messageIDs(r.p.Messages); !slices.Equal(got, want) {
			t.Errorf("%s: claimed %v, want %v", r.queue, got, want)
		}
	}
	// The blocking pass, the combined one, and q0's second.
	if sent, waiting := claim.CombinerCounts(comb); sent != 3 || waiting != 0 {
		t.Errorf("%d passes sent, %d calls waiting; want 3 and 0", sent, waiting)
	}
	var unclaimed int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM queue_messages WHERE queue_name = 'stopped' AND claim_token IS NULL`).Scan(&unclaimed); err != nil {
		t.Fatal(err)
	}
	if unclaimed != 2 {
		t.Errorf("%d of the stopped caller's messages unclaimed, want 2", unclaimed)
	}
}

// TestCombinerAlone: while fewer passes than its limit are in flight, a
// Combiner sends each at once, on its own.
func TestCombinerAlone(t *testing.T) {
	ctx := context.Background()
	pool, c, appID := setup(t)
	a := enqueueN(t, c, "app", "a", 1, bellhop.EnqueueOptions{})
	owner := uuid.New()
	comb := claim.NewCombiner(pool, 2, time.Minute)
	release := blockPass(t, pool, comb, appID, owner)
	p, err := comb.Pass(ctx, claim.Request{Target: claim.Target{Source: claim.Queue, AppID: appID, Queue: "a"}, Max: 1,
		Busy: claim.Busy{Owner: owner, Lease: time.Minute}})
	if err != nil {
		t.Fatal(err)
	}
	if got := messageIDs(p.Messages); !slices.Equal(got, a) {
		t.Errorf("claimed %v, want %v", got, a)
	}
	if _, err := release(); err != nil {
		t.Fatal(err)
	}
	if sent, _ := claim.CombinerCounts(comb); sent != 2 {
		t.Errorf("%d passes sent, want 2", sent)
	}
}

// TestCombinerCapsMessages: waiting passes combine only while the
// messages they ask for stay within MaxCombinedMessages; the rest go in
// passes of their own.
func TestCombinerCapsMessages(t *testing.T) {
	for _, tc := range []struct {
		max  int
		sent int64 // the blocking pass included
	}{
		{claim.MaxCombinedMessages / 3, 2},    // all three in one pass
		{claim.MaxCombinedMessages / 2, 3},    // two, then the third
		{claim.MaxCombinedMessages/2 + 1, 4},  // each alone
		{claim.MaxCombinedMessages + 5000, 4}, // one alone asks for more
	} {
		t.Run(fmt.Sprint(tc.max), func(t *testing.T) {
			ctx := context.Background()
			pool, c, appID := setup(t)
			queues := []string{"q0", "q1", "q2"}
			for _, q := range queues {
				enqueueN(t, c, "app", q, 1, bellhop.EnqueueOptions{})
			}
			owner := uuid.New()
			comb := claim.NewCombiner(pool, 1, time.Minute)
			release := blockPass(t, pool, comb, appID, owner)
			var wg sync.WaitGroup
			claimed := make(chan int, len(queues))
			for _, q := range queues {
				wg.Go(func() {
					p, err := comb.Pass(ctx, claim.Request{Target: claim.Target{Source: claim.Queue, AppID: appID, Queue: q}, Max: tc.max,
						Busy: claim.Busy{Owner: owner, Lease: time.Minute}})
					if err != nil {
						t.Errorf("%s: %v", q, err)
					}
					claimed <- len(p.Messages)
				})
			}
			waitFor(t, "all calls waiting", func() bool {
				_, waiting := claim.CombinerCounts(comb)
				return waiting == len(queues)
			})
			if _, err := release(); err != nil {
				t.Fatal(err)
			}
			wg.Wait()
			close(claimed)
			for n := range claimed {
				if n != 1 {
					t.Errorf("a pass claimed %d messages, want its queue's 1", n)
				}
			}
			if sent, _ := claim.CombinerCounts(comb); sent != tc.sent {
				t.Errorf("Max %d: %d passes sent, want %d", tc.max, sent, tc.sent)
			}
		})
	}
}

// TestCombinerTimeout: a pass that has not answered within the
// Combiner's timeout fails with an error that says so, while the lock it
// waits for is still held; its backend stops waiting (pgx's cancel
// request), and never runs the statement; and the pass that waited behind
// it goes, and claims.
func TestCombinerTimeout(t *testing.T) {
	ctx := context.Background()
	pool, c, appID := setup(t)
	a := enqueueN(t, c, "app", "a", 1, bellhop.EnqueueOptions{})
	owner := uuid.New()
	const timeout = 500 * time.Millisecond
	comb := claim.NewCombiner(pool, 1, timeout)
	release := blockPass(t, pool, comb, appID, owner)
	start := time.Now()
	behind := passAsync(ctx, comb, claim.Request{Target: claim.Target{Source: claim.Queue, AppID: appID, Queue: "a"}, Max: 1,
		Busy: claim.Busy{Owner: owner, Lease: time.Minute}})
	var r passResult
	select {
	case r = <-behind:
	case <-time.After(10 * time.Second):
		release() // or the pool's close waits for the blocked pass
		t.Fatal("the pass behind the blocked one did not go")
	}
	if r.err != nil {
		t.Fatalf("the pass behind the blocked one: %v", r.err)
	}
	if got := messageIDs(r.p.Messages); !slices.Equal(got, a) {
		t.Errorf("the pass behind the blocked one claimed %v, want %v", got, a)
	}
	if waited := time.Since(start); waited < timeout/2 {
		t.Errorf("the pass behind went after %s, before the blocked one timed out", waited)
	}
	// The lock is still held, and nobody waits for it any more.
	waitFor(t, "the blocked pass's backend to stop waiting for the lock", func() bool { return lockWaiters(t, pool) == 0 })
	if _, err := release(); err == nil || !strings.Contains(err.Error(), "no answer within 500ms") {
		t.Errorf("the blocked pass returned %v, want an error that says it had no answer within 500ms", err)
	}
	var marks int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM queue_busy WHERE queue_name = 'blocker'`).Scan(&marks); err != nil {
		t.Fatal(err)
	}
	if marks != 0 {
		t.Errorf("%d busy marks on the blocked pass's queue: its cancelled statement ran after all", marks)
	}
}

// TestCombinerStoppedCallerClaimsNothing: a caller stopped before it asks
// for a pass gets an empty one, and nothing is leased, as one stopped
// while its pass waits does. The pass used to be sent when it could go at
// once: its messages were leased only to be released, and against a
// stalled server the stop waited StopWait for it.
func TestCombinerStoppedCallerClaimsNothing(t *testing.T) {
	pool, c, appID := setup(t)
	enqueueN(t, c, "app", "a", 3, bellhop.EnqueueOptions{})
	comb := claim.NewCombiner(pool, 2, time.Minute)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	p, err := comb.Pass(ctx, claim.Request{Target: claim.Target{Source: claim.Queue, AppID: appID, Queue: "a"}, Max: 3,
		Busy: claim.Busy{Owner: uuid.New(), Lease: time.Minute}})
	if err != nil || len(p.Messages) != 0 {
		t.Errorf("a stopped caller's pass: %d messages, error %v; want none", len(p.Messages), err)
	}
	var leased int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM queue_messages WHERE claim_token IS NOT NULL`).Scan(&leased); err != nil {
		t.Fatal(err)
	}
	if leased != 0 {
		t.Errorf("%d messages leased by a stopped caller's pass, want 0", leased)
	}
}
