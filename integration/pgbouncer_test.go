package integration

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgbouncer"
	"github.com/bellhopq/bellhop/internal/syncbuf"
	"github.com/bellhopq/bellhop/notify"
)

// needPgBouncer skips t without the pgbouncer binary, unless
// BELLHOP_REQUIRE_PGBOUNCER is set (as .ci/run sets it): then it fails.
func needPgBouncer(t *testing.T) {
	t.Helper()
	if _, err := pgbouncer.Find(); err != nil {
		if os.Getenv("BELLHOP_REQUIRE_PGBOUNCER") != "" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
}

// TestProducersThroughPgBouncer: producers that reach the server through
// PgBouncer's transaction pooling, with default_query_exec_mode=exec in
// their connection string as docs/guarantees.md says, enqueue without a
// failure (single messages, batches and EnqueueTx, 16 at once on 4
// server connections), and a dispatcher on a direct connection delivers
// every message once, woken by their notifications (the fallback poll is
// an hour away).
//
// It needs the pgbouncer binary (needPgBouncer).
func TestProducersThroughPgBouncer(t *testing.T) {
	needPgBouncer(t)
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders", MaxInFlight: 50})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	b, err := pgbouncer.Start(ctx, pgbouncer.Options{Server: e.dsn, PoolMode: "transaction", PoolSize: 4})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Stop() })
	server, err := pgconn.ParseConfig(e.dsn)
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(ctx, b.ConnString(server.Database)+"&default_query_exec_mode=exec")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	producer := bellhop.NewClient(pool)

	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour}, nil)

	const producers, rounds = 16, 20 // each round: 1 + 2 + 1 messages
	var wg sync.WaitGroup
	errs := make(chan error, producers*rounds*3)
	for p := range producers {
		wg.Go(func() {
			for r := range rounds {
				msg := func(i int) []byte { return fmt.Appendf(nil, `{"p":%d,"r":%d,"i":%d}`, p, r, i) }
				if _, err := producer.Enqueue(ctx, "app", "orders", msg(0), bellhop.EnqueueOptions{}); err != nil {
					errs <- fmt.Errorf("Enqueue: %w", err)
				}
				if _, err := producer.EnqueueMany(ctx, "app", []bellhop.NewMessage{{Queue: "orders", Payload: msg(1)}, {Queue: "orders", Payload: msg(2)}}); err != nil {
					errs <- fmt.Errorf("EnqueueMany: %w", err)
				}
				tx, err := pool.Begin(ctx)
				if err != nil {
					errs <- fmt.Errorf("Begin: %w", err)
					continue
				}
				if _, err := producer.EnqueueTx(ctx, tx, "app", "orders", msg(3), bellhop.EnqueueOptions{}); err != nil {
					errs <- fmt.Errorf("EnqueueTx: %w", err)
				}
				if err := tx.Commit(ctx); err != nil {
					errs <- fmt.Errorf("Commit: %w", err)
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	failed := 0
	for err := range errs {
		if failed++; failed <= 3 {
			t.Errorf("through PgBouncer: %v", err)
		}
	}
	if failed > 0 {
		t.Fatalf("%d producer calls failed through PgBouncer's transaction pooling", failed)
	}
	const want = producers * rounds * 4
	waitFor(t, 30*time.Second, fmt.Sprintf("%d messages delivered", want), func() bool { return len(rec.deliveries()) >= want })
	seen := map[string]bool{}
	for _, d := range rec.deliveries() {
		if seen[string(d.Payload)] {
			t.Errorf("%s delivered twice", d.Payload)
		}
		seen[string(d.Payload)] = true
	}
	if len(seen) != want {
		t.Errorf("%d distinct messages delivered, want %d", len(seen), want)
	}
}

// TestDispatcherThroughPgBouncerSession: a dispatcher can run through
// PgBouncer in session mode as docs/guarantees.md says. Without
// synchronous_commit and default_transaction_isolation in PgBouncer's
// ignore_startup_parameters, Run fails at start-up and says which
// parameter PgBouncer refused. With them, and the two settings on the
// role in the database, it listens, claims and acks through PgBouncer:
// every message is delivered once, woken by its notification (the
// fallback poll is an hour away). Through transaction pooling, where its
// LISTEN cannot work, its first missed heartbeat names the problem.
func TestDispatcherThroughPgBouncerSession(t *testing.T) {
	needPgBouncer(t)
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders"})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	server, err := pgconn.ParseConfig(e.dsn)
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)

	t.Run("start-up parameters refused", func(t *testing.T) {
		b, err := pgbouncer.Start(ctx, pgbouncer.Options{Server: e.dsn, PoolMode: "session", PoolSize: 20})
		if err != nil {
			t.Fatal(err)
		}
		defer b.Stop()
		cfg, err := pgxpool.ParseConfig(b.ConnString(server.Database))
		if err != nil {
			t.Fatal(err)
		}
		d, err := bellhop.NewDispatcher(cfg, bellhop.DispatcherConfig{Resolver: mux, Logger: testLogger(t)})
		if err != nil {
			t.Fatal(err)
		}
		runCtx, stop := context.WithTimeout(ctx, 30*time.Second)
		defer stop()
		err = d.Run(runCtx)
		if err == nil || !strings.Contains(err.Error(), "unsupported startup parameter") {
			t.Errorf("Run through PgBouncer that refuses its start-up parameters = %v, want an error that names them", err)
		}
	})

	t.Run("ignored, and set on the role", func(t *testing.T) {
		b, err := pgbouncer.Start(ctx, pgbouncer.Options{Server: e.dsn, PoolMode: "session", PoolSize: 20,
			IgnoreStartupParameters: []string{"synchronous_commit", "default_transaction_isolation"}})
		if err != nil {
			t.Fatal(err)
		}
		defer b.Stop()
		role := pgx.Identifier{server.User}.Sanitize()
		db := pgx.Identifier{server.Database}.Sanitize()
		for _, set := range []string{"synchronous_commit = off", "default_transaction_isolation = 'read committed'"} {
			if _, err := e.pool.Exec(ctx, "ALTER ROLE "+role+" IN DATABASE "+db+" SET "+set); err != nil {
				t.Fatal(err)
			}
		}
		r := startDispatcher(t, b.ConnString(server.Database), bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour}, nil)
		defer r.stop()
		const n = 50
		for i := range n {
			e.enqueue(t, "orders", map[string]int{"i": i}, bellhop.EnqueueOptions{})
		}
		waitFor(t, 30*time.Second, fmt.Sprintf("%d messages delivered", n), func() bool { return len(rec.deliveries()) >= n })
		waitFor(t, 10*time.Second, "every message acked", func() bool { return e.count(t, `SELECT count(*) FROM queue_messages`) == 0 })
		if got := len(rec.deliveries()); got != n {
			t.Errorf("%d deliveries of %d messages", got, n)
		}
	})

	// The listener's LISTEN lands on one server session and its wait on
	// others: the dispatcher starts, and its first missed heartbeat says
	// what is wrong. With the poll an hour away, the heartbeats are those
	// sent after connecting (wake_scan.sql); with a short poll, the poll's
	// count too.
	for _, poll := range []time.Duration{time.Hour, 200 * time.Millisecond} {
		t.Run(fmt.Sprintf("transaction pooling, poll %s", poll), func(t *testing.T) {
			b, err := pgbouncer.Start(ctx, pgbouncer.Options{Server: e.dsn, PoolMode: "transaction", PoolSize: 20,
				IgnoreStartupParameters: []string{"synchronous_commit", "default_transaction_isolation"}})
			if err != nil {
				t.Fatal(err)
			}
			defer b.Stop()
			logs := &syncbuf.Buffer{}
			r := startLogged(t, b.ConnString(server.Database)+"&default_query_exec_mode=exec", bellhop.DispatcherConfig{Resolver: mux,
				PollInterval: poll, HeartbeatTimeout: 300 * time.Millisecond,
				Logger: zerolog.New(logs).Level(zerolog.WarnLevel)}, nil)
			defer r.stop()
			waitFor(t, 10*time.Second, "a missed heartbeat that names transaction pooling", func() bool {
				return strings.Contains(logs.String(), `"hint":"no heartbeat has ever come back: LISTEN needs a session of its own`)
			})
			// From the second miss, it is not ready either, whenever the
			// listener is connected.
			waitFor(t, 20*time.Second, "Ready to report the listener deaf", func() bool {
				return errors.Is(r.Ready(ctx), notify.ErrDeaf)
			})
			if poll == time.Hour {
				// Deaf, it sends no more heartbeats after connecting, so it
				// does not reconnect every HeartbeatTimeout.
				holdsFor(t, 5*300*time.Millisecond, "two missed heartbeats, no more", func() bool {
					return r.ListenerStats().HungRestarts == 2
				})
			}
		})
	}
}
