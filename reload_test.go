package bellhop

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

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
			con, err := client.RegisterConsumer(ctx, ConsumerSpec{App: "app", Queue: "orders", MaxInFlight: 10, MaxAttempts: 5})
			if err != nil {
				t.Fatal(err)
			}

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
			rctx, cancel := context.WithCancel(ctx)
			ran := make(chan error, 1)
			go func() { ran <- d.Run(rctx) }()
			t.Cleanup(func() {
				gate.release()
				close(done)
				cancel()
				if err := <-ran; err != nil {
					t.Errorf("Run: %v", err)
				}
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
				if err := pool.QueryRow(ctx, `SELECT count(*) FROM queue_messages WHERE claim_token IS NULL`).Scan(&k); err != nil {
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
