package bellhop_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgtest"
	"github.com/bellhopq/bellhop/internal/syncbuf"
)

// TestQueryExecModes: the client and the dispatcher work in each of
// pgx's query execution modes (default_query_exec_mode in the connection
// string), not only the default, which prepares and caches statements.
// A pool behind PgBouncer's transaction pooling needs one that does not
// (docs/guarantees.md, "PgBouncer"), and the uuids that Bellhop passes
// had no text encoding, so that exec and simple_protocol failed every
// call. Each mode, with and without leasing at INSERT: every Client call
// that writes or reads, then a dispatcher that delivers, retries,
// dead-letters and, after a redrive, delivers again; that delivers a
// message whose notification was never sent, by its fallback poll; and
// that logs no warning other than for the handler's own failures.
func TestQueryExecModes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		mode  string
		lease bool
	}{
		{"cache_statement", false}, {"cache_describe", false}, {"describe_exec", false}, {"exec", false}, {"simple_protocol", false},
		{"cache_statement", true}, {"exec", true}, {"simple_protocol", true},
	} {
		mode := tc.mode
		name := mode
		if tc.lease {
			name += ", leasing at INSERT"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			dsn := withParam(pgtest.ConnString(t), "default_query_exec_mode", mode)
			pool, err := pgxpool.New(ctx, dsn)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			c := bellhop.NewClient(pool)
			must := func(what string, err error) {
				t.Helper()
				if err != nil {
					t.Fatalf("%s: %v", what, err)
				}
			}

			app, err := c.CreateApp(ctx, "shop")
			must("CreateApp", err)
			apps, err := c.Apps(ctx)
			must("Apps", err)
			if len(apps) != 1 || apps[0].ID != app.ID {
				t.Errorf("Apps = %v, want the one created", apps)
			}
			principal, err := c.CreatePrincipal(ctx, "shop", "producer")
			must("CreatePrincipal", err)
			cons, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders", MaxAttempts: 2,
				BackoffBase: time.Millisecond, BackoffCap: time.Millisecond})
			must("RegisterConsumer", err)
			must("UpdateConsumer", c.UpdateConsumer(ctx, "shop", cons.ID, bellhop.ConsumerUpdate{MaxInFlight: new(20)}))
			must("SetConsumerEnabled", c.SetConsumerEnabled(ctx, "shop", cons.ID, true))
			got, err := c.ConsumerOf(ctx, "shop", "orders")
			must("ConsumerOf", err)
			if got.ID != cons.ID || got.MaxInFlight != 20 {
				t.Errorf("ConsumerOf = %v, want %s with max in-flight 20", got, cons.ID)
			}
			all, err := c.Consumers(ctx, "shop")
			must("Consumers", err)
			if len(all) != 1 {
				t.Errorf("Consumers = %d, want 1", len(all))
			}
			other, err := c.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "shop", Queue: "gone"})
			must("RegisterConsumer", err)
			must("RemoveConsumer", c.RemoveConsumer(ctx, "shop", other.ID))

			// ok acks, retry fails once then acks, dead fails for good.
			_, err = c.Enqueue(ctx, "shop", "orders", []byte(`"ok"`), bellhop.EnqueueOptions{})
			must("Enqueue", err)
			_, err = c.As(principal).Enqueue(ctx, "shop", "orders", []byte(`"retry"`), bellhop.EnqueueOptions{Principal: principal})
			must("Enqueue as a principal", err)
			tx, err := pool.Begin(ctx)
			must("Begin", err)
			_, err = c.EnqueueTx(ctx, tx, "shop", "orders", []byte(`"dead"`), bellhop.EnqueueOptions{MaxAttempts: 1})
			must("EnqueueTx", err)
			_, err = c.EnqueueManyTx(ctx, tx, "shop", []bellhop.NewMessage{{Queue: "orders", Payload: []byte(`"ok"`),
				Options: bellhop.EnqueueOptions{Delay: 10 * time.Millisecond}}})
			must("EnqueueManyTx", err)
			must("Commit", tx.Commit(ctx))
			_, err = c.EnqueueMany(ctx, "shop", []bellhop.NewMessage{{Queue: "orders", Payload: []byte(`"ok"`)},
				{Queue: "idle", Payload: []byte(`1`), Options: bellhop.EnqueueOptions{Principal: principal}}})
			must("EnqueueMany", err)
			_, err = c.Enqueue(ctx, "shop", "orders", []byte(`{`), bellhop.EnqueueOptions{})
			if !errors.Is(err, bellhop.ErrInvalidPayload) {
				t.Errorf("Enqueue of bad JSON = %v, want ErrInvalidPayload", err)
			}
			queues, err := c.Queues(ctx, "shop")
			must("Queues", err)
			if len(queues) != 2 {
				t.Errorf("Queues = %v, want orders and idle", queues)
			}

			var (
				mu      sync.Mutex
				handled = map[string]int{}
			)
			mux := bellhop.NewMux()
			mux.Handle("shop", "orders", bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
				mu.Lock()
				defer mu.Unlock()
				p := string(m.Payload)
				handled[p]++
				switch {
				case p == `"dead"` && handled[p] == 1:
					return bellhop.Permanent(errors.New("no"))
				case p == `"retry"` && handled[p] == 1:
					return errors.New("once")
				}
				if err := m.ExtendLease(ctx); err != nil {
					t.Errorf("ExtendLease of %s: %v", p, err)
				}
				return nil
			}))
			logs := &syncbuf.Buffer{}
			cfg, err := pgxpool.ParseConfig(dsn)
			must("ParseConfig", err)
			runDispatcherOn(t, cfg, mux, func(dc *bellhop.DispatcherConfig) {
				dc.PollInterval, dc.LeaseAtInsert = 200*time.Millisecond, tc.lease
				dc.Logger = zerolog.New(logs).Level(zerolog.WarnLevel)
			})
			count := func(p string) int {
				mu.Lock()
				defer mu.Unlock()
				return handled[p]
			}
			smokeWait(t, 20*time.Second, "the messages handled", func() bool {
				return count(`"ok"`) == 3 && count(`"retry"`) == 2 && count(`"dead"`) == 1
			})
			var dead []bellhop.DeadLetter
			smokeWait(t, 10*time.Second, "a dead letter", func() bool {
				dead, err = c.DeadLetters(ctx, bellhop.DeadFilter{App: "shop"})
				must("DeadLetters", err)
				return len(dead) == 1
			})
			n, err := c.Redrive(ctx, "shop", "orders", dead[0].ID)
			must("Redrive", err)
			if n != 1 {
				t.Fatalf("Redrive = %d, want 1", n)
			}
			smokeWait(t, 20*time.Second, "the redriven message handled", func() bool { return count(`"dead"`) == 2 })
			smokeWait(t, 10*time.Second, "orders to empty", func() bool {
				var left int
				must("count", pool.QueryRow(ctx, `SELECT count(*) FROM queue_messages WHERE queue_name = 'orders'`).Scan(&left))
				return left == 0
			})
			n, err = c.PurgeDead(ctx, "shop", "", uuid.Nil)
			must("PurgeDead", err)
			if n != 0 {
				t.Errorf("PurgeDead = %d, want 0 (the dead letter was redriven)", n)
			}

			// A notification lost: the poll finds the message.
			_, err = pool.Exec(ctx, `ALTER TABLE queue_messages DISABLE TRIGGER queue_messages_notify`)
			must("disable the notify trigger", err)
			_, err = c.Enqueue(ctx, "shop", "orders", []byte(`"unannounced"`), bellhop.EnqueueOptions{})
			must("Enqueue", err)
			smokeWait(t, 10*time.Second, "the unannounced message handled by the poll", func() bool { return count(`"unannounced"`) == 1 })

			for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
				if line == "" || strings.Contains(line, `"error":"once"`) || strings.Contains(line, `"error":"permanent: no"`) {
					continue // the handler's own failures
				}
				t.Errorf("logged: %s", line)
			}
		})
	}
}

// withParam adds a parameter to a connection string, URL or keyword/value.
func withParam(dsn, key, value string) string {
	if !strings.Contains(dsn, "://") {
		return dsn + " " + key + "=" + value
	}
	if strings.Contains(dsn, "?") {
		return dsn + "&" + key + "=" + value
	}
	return dsn + "?" + key + "=" + value
}
