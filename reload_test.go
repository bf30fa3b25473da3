package bellhop

import (
	"context"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop/internal/pgtest"
)

// TestReloadDuringClaim: a consumer change that the dispatcher has loaded
// while a claim pass was on its way applies to what that pass claims. The
// pass's claim statement is held back until the change is committed and
// in the lane's state. Found by review: the pass delivered with the
// settings it read before claiming, so a paused consumer got its
// messages, a lower in-flight limit was exceeded, and the old handler
// (for a push consumer, the old URL) delivered.
func TestReloadDuringClaim(t *testing.T) {
	const n = 5
	tests := []struct {
		name    string
		update  ConsumerUpdate
		loaded  func(Consumer) bool // the lane's state has the change
		started int                 // handlers that start
		waiting int                 // messages given back, unclaimed
	}{
		{"new handler", ConsumerUpdate{MaxAttempts: ptr(7)}, func(c Consumer) bool { return c.MaxAttempts == 7 }, n, 0},
		{"pause", ConsumerUpdate{Enabled: ptr(false)}, func(c Consumer) bool { return !c.Enabled }, 0, n},
		{"lower limit", ConsumerUpdate{MaxInFlight: ptr(1)}, func(c Consumer) bool { return c.MaxInFlight == 1 }, 1, n - 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			cfg, client, con := reloadSetup(t, ConsumerSpec{Queue: "orders", MaxInFlight: 10, MaxAttempts: 5})

			// Each handler knows the max attempts of the consumer it was
			// resolved for; it blocks until the test ends.
			var started, stale atomic.Int32
			done := make(chan struct{})
			resolver := resolverFunc(func(c Consumer) Handler {
				return HandlerFunc(func(ctx context.Context, _ *Message) error {
					started.Add(1)
					if c.MaxAttempts != 7 && tt.name == "new handler" {
						stale.Add(1)
					}
					select {
					case <-done:
					case <-ctx.Done():
					}
					return nil
				})
			})
			gate := &claimGate{open: make(chan struct{}), held: make(chan struct{}, 1), ended: make(chan struct{})}
			cfg.ConnConfig.Tracer = gate
			d, err := NewDispatcher(cfg, DispatcherConfig{Resolver: resolver, PollInterval: time.Hour, Logger: zerolog.Nop()})
			if err != nil {
				t.Fatal(err)
			}
			runUntilCleanup(t, d, func() {
				gate.release()
				close(done)
			})
			state := func() (Consumer, bool) {
				d.mu.Lock()
				defer d.mu.Unlock()
				cl := d.lanes[con.ID]
				if cl == nil {
					return Consumer{}, false
				}
				return cl.queue.state.Load().Consumer, true
			}
			eventually(t, "the consumer's lane", func() bool { _, ok := state(); return ok })

			gate.armed.Store(true)
			msgs := make([]NewMessage, n)
			for i := range msgs {
				msgs[i] = NewMessage{Queue: "orders", Payload: []byte(`{}`)}
			}
			if _, err := client.EnqueueMany(ctx, "app", msgs); err != nil {
				t.Fatal(err)
			}
			select {
			case <-gate.held:
			case <-time.After(10 * time.Second):
				t.Fatal("no claim statement within 10s of the enqueue")
			}
			if err := client.UpdateConsumer(ctx, "app", con.ID, tt.update); err != nil {
				t.Fatal(err)
			}
			eventually(t, "the change in the lane's state", func() bool { c, _ := state(); return tt.loaded(c) })
			gate.release()
			select {
			case <-gate.ended:
			case <-time.After(10 * time.Second):
				t.Fatal("the held claim did not end within 10s of its release")
			}

			unclaimed := func() int {
				var k int
				if err := client.db.QueryRow(ctx, `SELECT count(*) FROM queue_messages WHERE claim_token IS NULL`).Scan(&k); err != nil {
					t.Fatal(err)
				}
				return k
			}
			eventually(t, "the pass's messages started or given back", func() bool {
				return int(started.Load()) == tt.started && unclaimed() == tt.waiting
			})
			if s := stale.Load(); s != 0 {
				t.Errorf("%d of the pass's messages went to the handler resolved before the change", s)
			}
			if s := started.Load(); int(s) != tt.started {
				t.Errorf("%d handlers started, want %d", s, tt.started)
			}
		})
	}
}

func ptr[T any](v T) *T { return &v }

type resolverFunc func(Consumer) Handler

func (f resolverFunc) Resolve(c Consumer) Handler { return f(c) }

// claimGate holds back the first queue claim statement, sent alone or in
// a batch, while armed, until released, and reports when it has ended.
type claimGate struct {
	armed atomic.Bool
	open  chan struct{}
	once  sync.Once
	held  chan struct{} // one signal: a claim is held
	ended chan struct{} // closed when the held claim has run
}

// heldClaim marks the context of the held statement.
type heldClaim struct{}

func (g *claimGate) wait(ctx context.Context, sql string) context.Context {
	if strings.Contains(sql, "SET claim_token = gen_random_uuid()") && strings.Contains(sql, "FROM queue_messages AS c") &&
		g.armed.CompareAndSwap(true, false) {
		g.held <- struct{}{}
		<-g.open
		return context.WithValue(ctx, heldClaim{}, true)
	}
	return ctx
}

func (g *claimGate) end(ctx context.Context) {
	if ctx.Value(heldClaim{}) != nil {
		close(g.ended)
	}
}

func (g *claimGate) release() { g.once.Do(func() { close(g.open) }) }

func (g *claimGate) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	return g.wait(ctx, d.SQL)
}

func (g *claimGate) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	g.end(ctx)
}

func (g *claimGate) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	for _, q := range d.Batch.QueuedQueries {
		ctx = g.wait(ctx, q.SQL)
	}
	return ctx
}

func (g *claimGate) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (g *claimGate) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchEndData) {
	g.end(ctx)
}

// eventually polls cond until it holds, for at most 10s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after 10s waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestServedAgainKeepsInFlight: a consumer that a reload stops serving
// (its Resolver returns nil, as when it panics or a push consumer is
// refused) while a delivery runs, and that a later reload serves again,
// gets new lanes that count that delivery against MaxInFlight, and start
// the next delivery once it ends. The lanes kept for that are forgotten
// once their deliveries have ended. Found by review: the new lanes counted
// from zero, and at MaxInFlight 1 a second delivery ran beside the first.
func TestServedAgainKeepsInFlight(t *testing.T) {
	ctx := context.Background()
	cfg, client, con := reloadSetup(t, ConsumerSpec{Queue: "jobs", MaxInFlight: 1})

	// Each delivery waits for its own release.
	var running, peak atomic.Int32
	started := make(chan struct{}, 3)
	release := make(chan struct{})
	done := make(chan struct{})
	handler := HandlerFunc(func(ctx context.Context, _ *Message) error {
		n := running.Add(1)
		defer running.Add(-1)
		for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
		}
		started <- struct{}{}
		select {
		case <-release:
		case <-done:
		case <-ctx.Done():
		}
		return nil
	})
	var off atomic.Bool
	resolver := resolverFunc(func(Consumer) Handler {
		if off.Load() {
			return nil
		}
		return handler
	})
	d, err := NewDispatcher(cfg, DispatcherConfig{Resolver: resolver, PollInterval: time.Hour, Logger: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	runUntilCleanup(t, d, func() { close(done) })
	lanes := func() (served, held *consumerLanes) {
		d.mu.RLock()
		defer d.mu.RUnlock()
		return d.lanes[con.ID], d.holding[con.ID]
	}
	reload := func(serve bool) {
		t.Helper()
		off.Store(!serve)
		if _, err := client.db.Exec(ctx, `SELECT pg_notify('bellhop', 'c')`); err != nil {
			t.Fatal(err)
		}
		eventually(t, "the reload", func() bool { served, _ := lanes(); return (served != nil) == serve })
	}
	wait := func(what string) {
		t.Helper()
		select {
		case <-started:
		case <-time.After(10 * time.Second):
			t.Fatalf("%s did not start within 10s", what)
		}
	}
	enqueue := func() {
		t.Helper()
		if _, err := client.Enqueue(ctx, "app", "jobs", []byte(`{}`), EnqueueOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "the consumer's lanes", func() bool { served, _ := lanes(); return served != nil })

	enqueue()
	wait("the first delivery")
	first, _ := lanes()
	reload(false)
	if _, held := lanes(); held != first {
		t.Fatal("the lanes stopped while their delivery runs are not kept")
	}
	reload(true)
	second, held := lanes()
	if held != nil {
		t.Error("the kept lanes are still kept once the consumer is served again")
	}
	if second.queue.inFlight != first.queue.inFlight {
		t.Error("the new lanes do not share the old lanes' slot count")
	}
	enqueue()
	// The second message is claimable now; the new lane would claim it
	// at once with a slot of its own.
	deadline := time.Now().Add(500 * time.Millisecond)
	for time.Now().Before(deadline) {
		if p := peak.Load(); p > 1 {
			t.Fatalf("peak in flight %d, want 1 (MaxInFlight)", p)
		}
		time.Sleep(5 * time.Millisecond)
	}
	release <- struct{}{}
	// The slot freed by the old lanes' delivery wakes the new lanes.
	wait("the second delivery, once the first ended")
	if p := peak.Load(); p != 1 {
		t.Errorf("peak in flight %d, want 1 (MaxInFlight)", p)
	}

	// Stopped again with the second delivery running, and not served
	// again: the lanes are forgotten once it ends, with no reload.
	reload(false)
	if _, held := lanes(); held == nil {
		t.Fatal("the lanes stopped while their delivery runs are not kept")
	}
	release <- struct{}{}
	eventually(t, "the kept lanes forgotten once their delivery ended", func() bool { _, held := lanes(); return held == nil })
	d.mu.RLock()
	n := len(d.holding)
	d.mu.RUnlock()
	if n != 0 {
		t.Errorf("%d consumers' lanes kept, want none", n)
	}
}

// reloadSetup makes a test database with app "app" and spec's consumer
// registered in it (its App set to "app"), and returns the pool config for
// a dispatcher, a client on a pool of its own, and the consumer.
func reloadSetup(t *testing.T, spec ConsumerSpec) (*pgxpool.Config, *Client, Consumer) {
	t.Helper()
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(pgtest.ConnString(t))
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg.Copy())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	client := NewClient(pool)
	if _, err := client.CreateApp(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	spec.App = "app"
	con, err := client.RegisterConsumer(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	return cfg, client, con
}

// runUntilCleanup runs d until the test's cleanup, which calls before
// (to let blocked handlers return), stops d and checks Run's error.
func runUntilCleanup(t *testing.T, d *Dispatcher, before func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- d.Run(ctx) }()
	t.Cleanup(func() {
		if before != nil {
			before()
		}
		cancel()
		if err := <-ran; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
}

// TestResolverToggleSoak: for 5 seconds, a Resolver turns three
// consumers' service off and on at random while producers stream
// messages (leased at INSERT) and handlers take up to 30 ms, a quarter of
// them failing. No consumer ever runs more than MaxInFlight deliveries at
// once, the race detector finds nothing, and the dispatcher stops. Found
// by review: a consumer served again linked its old lanes to the new ones
// before the new ones were complete, and an old delivery that ended
// started the new lanes' goroutines, which read a field still being
// written (lane.after).
func TestResolverToggleSoak(t *testing.T) {
	ctx := context.Background()
	cfg, client, first := reloadSetup(t, ConsumerSpec{Queue: "a", MaxInFlight: 2, MaxAttempts: 100})
	ids := []uuid.UUID{first.ID}
	queues := []string{"a", "b", "c"}
	for _, q := range queues[1:] {
		c, err := client.RegisterConsumer(ctx, ConsumerSpec{App: "app", Queue: q, MaxInFlight: 2, MaxAttempts: 100})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, c.ID)
	}
	var mu sync.Mutex
	running := map[uuid.UUID]int{}
	peak := 0
	var delivered atomic.Int64
	handler := HandlerFunc(func(ctx context.Context, m *Message) error {
		mu.Lock()
		running[m.ConsumerID]++
		peak = max(peak, running[m.ConsumerID])
		mu.Unlock()
		defer func() { mu.Lock(); running[m.ConsumerID]--; mu.Unlock() }()
		select {
		case <-time.After(time.Duration(rand.IntN(30)) * time.Millisecond): // the work
		case <-ctx.Done():
		}
		delivered.Add(1)
		if rand.IntN(4) == 0 {
			return RetryAfter(30 * time.Millisecond)
		}
		return nil
	})
	var off sync.Map
	resolver := resolverFunc(func(c Consumer) Handler {
		if v, ok := off.Load(c.ID); ok && v.(bool) {
			return nil
		}
		return handler
	})
	d, err := NewDispatcher(cfg, DispatcherConfig{Resolver: resolver, PollInterval: 100 * time.Millisecond,
		LeaseAtInsert: true, Logger: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ran := make(chan error, 1)
	go func() { ran <- d.Run(rctx) }()
	soak, stop := context.WithTimeout(ctx, 5*time.Second)
	defer stop()
	var wg sync.WaitGroup
	wg.Go(func() {
		for soak.Err() == nil {
			_, _ = client.Enqueue(ctx, "app", queues[rand.IntN(len(queues))], []byte(`{}`), EnqueueOptions{})
		}
	})
	wg.Go(func() {
		for soak.Err() == nil {
			off.Store(ids[rand.IntN(len(ids))], rand.IntN(2) == 0)
			if _, err := client.db.Exec(ctx, `SELECT pg_notify('bellhop', 'c')`); err != nil {
				t.Error(err)
				return
			}
			select {
			case <-time.After(time.Duration(rand.IntN(15)) * time.Millisecond): // the next toggle's time
			case <-soak.Done():
			}
		}
	})
	wg.Wait()
	cancel()
	select {
	case err := <-ran:
		if err != nil {
			t.Errorf("Run: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return within 30s of its stop")
	}
	mu.Lock()
	defer mu.Unlock()
	t.Logf("%d deliveries; at most %d at once for a consumer", delivered.Load(), peak)
	if peak > 2 {
		t.Errorf("a consumer ran %d deliveries at once, more than its MaxInFlight of 2", peak)
	}
	if delivered.Load() == 0 {
		t.Error("nothing was delivered")
	}
}

// TestSlowResolverDoesNotHoldUpDelivery: while a reload waits on a slow
// Resolver, notifications for the queues already served still wake their
// lanes. Found by review: the reload called the Resolver holding the
// lock that the listener's routing reads under, so every notification
// waited for the whole reload (PollInterval is an hour here).
func TestSlowResolverDoesNotHoldUpDelivery(t *testing.T) {
	ctx := context.Background()
	cfg, client, _ := reloadSetup(t, ConsumerSpec{Queue: "orders"})
	delivered := make(chan struct{}, 1)
	orders := HandlerFunc(func(context.Context, *Message) error {
		delivered <- struct{}{}
		return nil
	})
	resolving := make(chan struct{}, 1)
	slow := make(chan struct{})
	resolver := resolverFunc(func(c Consumer) Handler {
		if c.Queue == "slow" {
			resolving <- struct{}{}
			<-slow
		}
		return orders
	})
	d, err := NewDispatcher(cfg, DispatcherConfig{Resolver: resolver, PollInterval: time.Hour, Logger: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	unblock := func() { once.Do(func() { close(slow) }) }
	runUntilCleanup(t, d, unblock)
	eventually(t, "the dispatcher ready", func() bool { return d.Ready(ctx) == nil })

	if _, err := client.RegisterConsumer(ctx, ConsumerSpec{App: "app", Queue: "slow"}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-resolving:
	case <-time.After(10 * time.Second):
		t.Fatal("the reload did not ask the Resolver for the new consumer within 10s")
	}
	if _, err := client.Enqueue(ctx, "app", "orders", []byte(`{}`), EnqueueOptions{}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-delivered:
	case <-time.After(5 * time.Second):
		t.Error("no delivery within 5s while the Resolver was slow to answer for another consumer")
	}
	unblock()
}
