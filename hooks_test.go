package bellhop

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop/internal/busylock"
)

// TestConnectionsOutsideThePoolRunItsHooks: the pool config's
// BeforeConnect and AfterConnect run for the dispatcher's connections
// outside the pool, the listener's and the busy locks', as they do for the
// pool's own. Here the connection string names a database that does not
// exist and BeforeConnect names the right one, as a hook that sets
// rotated credentials would: the listener used to connect from the
// ConnConfig alone, failed for as long as the dispatcher ran, and left it
// deaf and never Ready (found by review); the busy locks' connection
// failed so too.
func TestConnectionsOutsideThePoolRunItsHooks(t *testing.T) {
	ctx := context.Background()
	cfg, client, con := reloadSetup(t, ConsumerSpec{Queue: "orders"})
	database := cfg.ConnConfig.Database
	cfg.ConnConfig.Database = "bellhop_no_such_database"
	cfg.BeforeConnect = func(_ context.Context, cc *pgx.ConnConfig) error {
		cc.Database = database
		return nil
	}
	var mu sync.Mutex
	var names []string
	cfg.AfterConnect = func(_ context.Context, c *pgx.Conn) error {
		mu.Lock()
		defer mu.Unlock()
		names = append(names, c.Config().RuntimeParams["application_name"])
		return nil
	}
	seen := func(name string) bool {
		mu.Lock()
		defer mu.Unlock()
		return slices.Contains(names, name)
	}
	delivered := make(chan struct{}, 1)
	d, err := NewDispatcher(cfg, DispatcherConfig{
		Resolver: resolverFunc(func(Consumer) Handler {
			return HandlerFunc(func(context.Context, *Message) error {
				select {
				case delivered <- struct{}{}:
				default:
				}
				return nil
			})
		}),
		PollInterval: time.Hour, Logger: zerolog.Nop(),
	})
	if err != nil {
		t.Fatal(err)
	}
	runUntilCleanup(t, d, nil)
	eventually(t, "the dispatcher Ready", func() bool { return d.Ready(ctx) == nil })
	if !seen("bellhop-listener") {
		t.Errorf("AfterConnect ran for %q, not for the listener", names)
	}
	// Heard, not polled: the poll is an hour away.
	if _, err := client.Enqueue(ctx, "app", "orders", []byte(`{}`), EnqueueOptions{}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-delivered:
	case <-time.After(10 * time.Second):
		t.Fatal("the message was not delivered within 10s")
	}
	key := busylock.Key{AppID: con.AppID, Queue: "other"}
	if _, err := d.marks.Hold(ctx, key); err != nil {
		t.Fatalf("the busy locks' connection: %v", err)
	}
	if _, err := d.marks.Release(ctx, key); err != nil {
		t.Fatal(err)
	}
	if !seen("bellhop-busy-locks") {
		t.Errorf("AfterConnect ran for %q, not for the busy locks", names)
	}
}

// TestListenerSessionAfterHook: the pool's AfterConnect runs on the
// listener's connection before the listener sets up its session, so a hook
// that sets idle_session_timeout (or RESET ALL, back to a role's default)
// does not undo it: the server would end a session that only waits for
// notifications every timeout (found by the review of this change, which
// first ran the hook after the set-up).
func TestListenerSessionAfterHook(t *testing.T) {
	ctx := context.Background()
	cfg, client, _ := reloadSetup(t, ConsumerSpec{Queue: "orders"})
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		if c.Config().RuntimeParams["application_name"] != "bellhop-listener" {
			return nil
		}
		_, err := c.Exec(ctx, "SET idle_session_timeout = '300ms'")
		return err
	}
	d, err := NewDispatcher(cfg, DispatcherConfig{Resolver: resolverFunc(func(Consumer) Handler { return nil }),
		PollInterval: time.Hour, Logger: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	runUntilCleanup(t, d, nil)
	eventually(t, "the dispatcher Ready", func() bool { return d.Ready(ctx) == nil })
	// Idle for over three times the hook's timeout, in one session.
	var idle bool
	deadline := time.Now().Add(10 * time.Second)
	for !idle {
		if time.Now().After(deadline) {
			t.Fatalf("the listener's session was not idle for 1s within 10s (%d sessions): the hook's idle_session_timeout ended it", d.ListenerStats().Connects)
		}
		if err := client.db.QueryRow(ctx, `SELECT coalesce(bool_or(state = 'idle' AND state_change < now() - interval '1s'), false)
			FROM pg_stat_activity WHERE application_name = 'bellhop-listener' AND datname = current_database()`).Scan(&idle); err != nil {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if n := d.ListenerStats().Connects; n != 1 {
		t.Errorf("the listener connected %d times, want once", n)
	}
}

// TestConnectHookErrorsNamed: an error of the pool's BeforeConnect or
// AfterConnect fails the listener's connect with the hook named, and the
// dispatcher is not Ready.
func TestConnectHookErrorsNamed(t *testing.T) {
	ctx := context.Background()
	for _, hook := range []string{"BeforeConnect", "AfterConnect"} {
		t.Run(hook, func(t *testing.T) {
			cfg, _, _ := reloadSetup(t, ConsumerSpec{Queue: "orders"})
			refused := errors.New("no token today")
			var listenerRefused sync.Once
			refusedOnce := make(chan struct{})
			// The pool's connections pass; the listener's is refused.
			switch hook {
			case "BeforeConnect":
				cfg.BeforeConnect = func(_ context.Context, cc *pgx.ConnConfig) error {
					if cc.RuntimeParams["application_name"] == "bellhop-dispatcher" {
						return nil
					}
					listenerRefused.Do(func() { close(refusedOnce) })
					return refused
				}
			case "AfterConnect":
				cfg.AfterConnect = func(_ context.Context, c *pgx.Conn) error {
					if c.Config().RuntimeParams["application_name"] == "bellhop-dispatcher" {
						return nil
					}
					listenerRefused.Do(func() { close(refusedOnce) })
					return refused
				}
			}
			d, err := NewDispatcher(cfg, DispatcherConfig{Resolver: resolverFunc(func(Consumer) Handler { return nil }),
				PollInterval: time.Hour, Logger: zerolog.Nop()})
			if err != nil {
				t.Fatal(err)
			}
			runUntilCleanup(t, d, nil)
			select {
			case <-refusedOnce:
			case <-time.After(10 * time.Second):
				t.Fatalf("%s was not called for the listener within 10s", hook)
			}
			eventually(t, "Run started", d.running.Load)
			if err := d.Ready(ctx); err == nil || !strings.Contains(err.Error(), "listener") {
				t.Errorf("Ready with the listener's %s failing: %v, want the listener not connected", hook, err)
			}
			_, err = d.marks.Hold(ctx, busylock.Key{Queue: "orders"})
			if !errors.Is(err, refused) || !strings.Contains(err.Error(), hook) {
				t.Errorf("Hold with the busy locks' %s failing: %v, want an error naming the hook and wrapping %q", hook, err, refused)
			}
		})
	}
}

// TestDefaultConnectTimeout: a pool config with no connect timeout (no
// connect_timeout in its connection string) gets 10s for the
// dispatcher's connections, the listener's and the busy locks' too, which
// are made from copies of it; one that sets its own keeps it. Without a
// bound, an attempt on a server that accepts and never answers waited
// until the kernel gave up (found by the lifecycle review).
func TestDefaultConnectTimeout(t *testing.T) {
	for _, tc := range []struct {
		param string
		want  time.Duration
	}{{"", defaultConnectTimeout}, {"&connect_timeout=3", 3 * time.Second}} {
		cfg, err := pgxpool.ParseConfig("postgres://u@127.0.0.1:1/db?sslmode=disable" + tc.param)
		if err != nil {
			t.Fatal(err)
		}
		d, err := NewDispatcher(cfg, DispatcherConfig{Resolver: resolverFunc(func(Consumer) Handler { return nil })})
		if err != nil {
			t.Fatal(err)
		}
		if got := d.poolCfg.ConnConfig.ConnectTimeout; got != tc.want {
			t.Errorf("connection string ...%s: the dispatcher's connect timeout is %s, want %s", tc.param, got, tc.want)
		}
		if cfg.ConnConfig.ConnectTimeout == defaultConnectTimeout && tc.param == "" {
			t.Errorf("NewDispatcher changed the caller's pool config")
		}
	}
}
