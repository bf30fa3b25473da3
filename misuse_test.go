package bellhop_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
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
	"github.com/bellhopq/bellhop/internal/pgtest"
	"github.com/bellhopq/bellhop/migrations"
	"github.com/bellhopq/bellhop/notify"
)

// nilErr is a handler's own error type whose Error reads a field, so a nil
// *nilErr in a non-nil error panics when asked for its text.
type nilErr struct{ msg string }

func (e *nilErr) Error() string { return e.msg }

// TestTypedNilHandlerError: a handler that returns a nil pointer of its own
// error type (a non-nil error whose Error method panics), alone or inside
// Permanent, fails its delivery like any error. It crashed the process:
// the dispatcher read the error's text outside any recover.
func TestTypedNilHandlerError(t *testing.T) {
	for _, c := range []struct {
		name string
		wrap func(error) error
	}{
		{"bare", func(err error) error { return err }},
		{"permanent", bellhop.Permanent},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := fxNew(t)
			e.app("shop")
			if _, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders", MaxAttempts: 1}); err != nil {
				t.Fatal(err)
			}
			mux := bellhop.NewMux()
			mux.Handle("shop", "orders", bellhop.HandlerFunc(func(context.Context, *bellhop.Message) error {
				var err *nilErr
				return c.wrap(err)
			}))
			runDispatcher(t, e.pool.Config().ConnString(), mux)
			id, err := e.client.Enqueue(e.ctx, "shop", "orders", []byte(`1`), bellhop.EnqueueOptions{})
			if err != nil {
				t.Fatal(err)
			}
			waitUntil(t, 10*time.Second, "the dead letter", func() bool {
				return e.int64(`SELECT count(*) FROM dead_letters WHERE id = $1`, id) == 1
			})
			ds, err := e.client.DeadLetters(e.ctx, bellhop.DeadFilter{App: "shop", ID: id})
			if err != nil || len(ds) != 1 {
				t.Fatalf("dead letter: %v, %v", ds, err)
			}
			if !strings.Contains(ds[0].LastError, "*bellhop_test.nilErr") || !strings.Contains(ds[0].LastError, "panicked") {
				t.Errorf("dead letter's error %q does not say what the handler returned", ds[0].LastError)
			}
		})
	}
}

// TestAsNilPrincipal: no principal has the id uuid.Nil, so a Client made
// with it (the zero value of a failed lookup) is refused. It acted as an
// operator, with rights on every app.
func TestAsNilPrincipal(t *testing.T) {
	e := fxNew(t)
	e.app("shop")
	cons, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	before := e.tableState("queue_messages")
	nobody := e.client.As(uuid.Nil)
	for _, c := range []struct {
		name string
		call func() error
		want error // ErrForbidden if nil
	}{
		{"CreateApp", func() error { _, err := nobody.CreateApp(e.ctx, "vianil"); return err }, nil},
		{"CreatePrincipal", func() error { _, err := nobody.CreatePrincipal(e.ctx, "shop", "p2"); return err }, nil},
		{"Enqueue", func() error {
			_, err := nobody.Enqueue(e.ctx, "shop", "orders", []byte(`1`), bellhop.EnqueueOptions{})
			return err
		}, nil},
		{"EnqueueMany", func() error {
			_, err := nobody.EnqueueMany(e.ctx, "shop", []bellhop.NewMessage{{Queue: "orders", Payload: []byte(`1`)}})
			return err
		}, nil},
		{"InvokeAsync", func() error { // others' consumers are reported as unknown
			_, err := nobody.InvokeAsync(e.ctx, cons.ID, []byte(`1`), bellhop.EnqueueOptions{})
			return err
		}, bellhop.ErrUnknownConsumer},
		{"RegisterConsumer", func() error {
			_, err := nobody.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "other"})
			return err
		}, nil},
		{"ConsumerOf", func() error { _, err := nobody.ConsumerOf(e.ctx, "shop", "orders"); return err }, nil},
		{"Queues", func() error { _, err := nobody.Queues(e.ctx, ""); return err }, nil},
	} {
		want := c.want
		if want == nil {
			want = bellhop.ErrForbidden
		}
		if err := c.call(); !errors.Is(err, want) {
			t.Errorf("As(uuid.Nil).%s: %v, want %v", c.name, err, want)
		}
	}
	if n := e.int64(`SELECT count(*) FROM outbox`); n != 0 {
		t.Error("As(uuid.Nil) invoked")
	}
	if n := e.int64(`SELECT count(*) FROM apps WHERE name = 'vianil'`); n != 0 {
		t.Error("As(uuid.Nil) created an app")
	}
	if after := e.tableState("queue_messages"); after != before {
		t.Error("As(uuid.Nil) enqueued")
	}
}

// TestRunOnce: a Dispatcher runs once. A second Run, after the first or
// beside it, returns an error at once; a concurrent one was accepted and
// ran a second listener on the first one's pool.
func TestRunOnce(t *testing.T) {
	e := fxNew(t)
	d := runDispatcher(t, e.pool.Config().ConnString(), bellhop.NewMux())
	done := make(chan error, 1)
	go func() { done <- d.Run(context.Background()) }()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "more than once") {
			t.Errorf("concurrent second Run: %v, want an error saying a Dispatcher runs once", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a concurrent second Run was accepted and is running")
	}
}

// TestNewDispatcherHoldsNothing: a Dispatcher that is made and never run
// opens no connection and starts no goroutine (there is no Close to
// release them): with pool_min_conns, pgxpool connected at once.
func TestNewDispatcherHoldsNothing(t *testing.T) {
	e := fxNew(t)
	cfg, err := pgxpool.ParseConfig(e.pool.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	cfg.MinConns = 2
	cfg.ConnConfig.RuntimeParams["application_name"] = "never_run"
	for range 2 {
		if _, err := bellhop.NewDispatcher(cfg, bellhop.DispatcherConfig{Resolver: bellhop.NewMux()}); err != nil {
			t.Fatal(err)
		}
	}
	// A pool that connects does so within milliseconds; after this long
	// its connections would show.
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		if n := e.int64(`SELECT count(*) FROM pg_stat_activity WHERE application_name = 'never_run' AND datname = current_database()`); n != 0 {
			t.Fatalf("%d connections of dispatchers that never ran", n)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if _, err := bellhop.NewDispatcher(&pgxpool.Config{}, bellhop.DispatcherConfig{Resolver: bellhop.NewMux()}); err == nil {
		t.Error("NewDispatcher with a zero pgxpool.Config: no error")
	}
	// Durations the database would round to 0: a lease of no time, a busy
	// mark that never times out.
	for _, dc := range []bellhop.DispatcherConfig{
		{DefaultVisibilityTimeout: 500 * time.Millisecond},
		{BusyLease: 900 * time.Microsecond, BusyWindow: 100 * time.Microsecond},
	} {
		dc.Resolver = bellhop.NewMux()
		if _, err := bellhop.NewDispatcher(cfg, dc); err == nil {
			t.Errorf("NewDispatcher with %+v: no error", dc)
		}
	}
}

// TestRunReturnsWithConsumerRowLocked: a stop's writes are bounded. The
// last one, last_fired_at, had no deadline, so a transaction holding a
// consumer's row kept Run from returning for as long as it lasted.
func TestRunReturnsWithConsumerRowLocked(t *testing.T) {
	e := fxNew(t)
	e.app("shop")
	c, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	var handled atomic.Int32
	mux := bellhop.NewMux()
	mux.Handle("shop", "orders", bellhop.HandlerFunc(func(context.Context, *bellhop.Message) error {
		handled.Add(1)
		return nil
	}))
	cfg, err := pgxpool.ParseConfig(e.pool.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	d, err := bellhop.NewDispatcher(cfg, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	defer func() {
		cancel()
		<-done
	}()
	locker, err := pgx.ConnectConfig(e.ctx, e.pool.Config().ConnConfig.Copy())
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Close(context.Background())
	tx, err := locker.Begin(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := tx.Exec(e.ctx, `SELECT 1 FROM queue_trigger_details WHERE trigger_id = $1 FOR UPDATE`, c.ID); err != nil {
		t.Fatal(err)
	}
	for i := int32(1); i <= 2; i++ {
		if _, err := e.client.Enqueue(e.ctx, "shop", "orders", []byte(`1`), bellhop.EnqueueOptions{}); err != nil {
			t.Fatal(err)
		}
		waitUntil(t, 10*time.Second, "the delivery", func() bool { return handled.Load() >= i })
		if i == 1 {
			waitUntil(t, 10*time.Second, "last_fired_at's update waiting for the row", func() bool {
				return e.int64(`SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%last_fired_at%'`) > 0
			})
		}
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run: %v", err)
		}
		done <- nil // for the deferred receive
	case <-time.After(20 * time.Second):
		t.Fatal("Run did not return within 20s of its cancel while another transaction held the consumer's row")
	}
}

// TestExtendLeaseWithEndedContext: a handler that renews with its own
// context after the dispatcher ended it for the lease gets ErrLeaseLost,
// as documented, not that context's error; so does one whose renewal was
// still waiting (here for the message's row, which another transaction
// holds) when the lease ended, which got "context canceled".
func TestExtendLeaseWithEndedContext(t *testing.T) {
	for _, waiting := range []bool{false, true} {
		t.Run(fmt.Sprintf("waiting=%t", waiting), func(t *testing.T) {
			e := fxNew(t)
			e.app("shop")
			if _, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders", VisibilityTimeout: time.Second, MaxAttempts: 1}); err != nil {
				t.Fatal(err)
			}
			type result struct{ cause, err error }
			got := make(chan result, 1)
			started := make(chan uuid.UUID, 1)
			locked := make(chan struct{})
			mux := bellhop.NewMux()
			mux.Handle("shop", "orders", bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
				if waiting {
					started <- m.ID
					select {
					case <-locked:
					case <-ctx.Done(): // the test failed before locking
					}
				} else {
					<-ctx.Done()
				}
				err := m.ExtendLease(ctx)
				got <- result{context.Cause(ctx), err}
				return ctx.Err()
			}))
			runDispatcher(t, e.pool.Config().ConnString(), mux)
			if _, err := e.client.Enqueue(e.ctx, "shop", "orders", []byte(`1`), bellhop.EnqueueOptions{}); err != nil {
				t.Fatal(err)
			}
			if waiting {
				var id uuid.UUID
				select {
				case id = <-started:
				case <-time.After(10 * time.Second):
					t.Fatal("the handler did not start")
				}
				tx, err := e.pool.Begin(e.ctx)
				if err != nil {
					t.Fatal(err)
				}
				defer tx.Rollback(context.Background())
				if _, err := tx.Exec(e.ctx, `SELECT 1 FROM queue_messages WHERE id = $1 FOR UPDATE`, id); err != nil {
					t.Fatal(err)
				}
				close(locked)
			}
			select {
			case r := <-got:
				if !errors.Is(r.cause, bellhop.ErrLeaseLost) {
					t.Fatalf("the handler's context ended with %v, not ErrLeaseLost", r.cause)
				}
				if !errors.Is(r.err, bellhop.ErrLeaseLost) {
					t.Errorf("ExtendLease with the ended context: %v, want ErrLeaseLost", r.err)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("the handler's context did not end")
			}
		})
	}
}

// TestUnstorableInput: input that PostgreSQL cannot take as text (invalid
// UTF-8, NUL) gets the typed error, not an encoding error from the server,
// and writes nothing.
func TestUnstorableInput(t *testing.T) {
	e := fxNew(t)
	e.app("shop")
	cons, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	bad := []byte("\"\xff\"") // valid to encoding/json, not UTF-8
	before := e.tableState("queue_messages")
	for _, c := range []struct {
		name string
		call func() error
		want error
	}{
		{"Enqueue, payload", func() error {
			_, err := e.client.Enqueue(e.ctx, "shop", "orders", bad, bellhop.EnqueueOptions{})
			return err
		}, bellhop.ErrInvalidPayload},
		{"EnqueueMany, payload", func() error {
			_, err := e.client.EnqueueMany(e.ctx, "shop", []bellhop.NewMessage{{Queue: "orders", Payload: []byte(`1`)}, {Queue: "orders", Payload: bad}})
			return err
		}, bellhop.ErrInvalidPayload},
		{"InvokeAsync, payload", func() error {
			_, err := e.client.InvokeAsync(e.ctx, cons.ID, bad, bellhop.EnqueueOptions{})
			return err
		}, bellhop.ErrInvalidPayload},
		{"Enqueue, app with NUL", func() error {
			_, err := e.client.Enqueue(e.ctx, "sh\x00op", "orders", []byte(`1`), bellhop.EnqueueOptions{})
			return err
		}, bellhop.ErrUnknownApp},
		{"Enqueue, app not UTF-8", func() error {
			_, err := e.client.Enqueue(e.ctx, "sh\xffop", "orders", []byte(`1`), bellhop.EnqueueOptions{})
			return err
		}, bellhop.ErrUnknownApp},
		{"RegisterConsumer, app not UTF-8", func() error {
			_, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "sh\xffop", Queue: "orders"})
			return err
		}, bellhop.ErrUnknownApp},
		// The server refused it with a bare encoding error.
		{"RegisterConsumer, URL not UTF-8", func() error {
			_, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "other", URL: "https://x.example.com/\xff"})
			return err
		}, bellhop.ErrInvalidOptions},
		{"UpdateConsumer, URL not UTF-8", func() error {
			url := "https://x.example.com/\xff"
			return e.client.UpdateConsumer(e.ctx, "shop", cons.ID, bellhop.ConsumerUpdate{URL: &url})
		}, bellhop.ErrInvalidOptions},
		{"CreatePrincipal, app with NUL", func() error {
			_, err := e.client.CreatePrincipal(e.ctx, "sh\x00op", "ops")
			return err
		}, bellhop.ErrUnknownApp},
		// ConsumerOf passed both names to the server: an encoding error
		// for these, ErrUnknownConsumer for an unknown app or a bad name.
		{"ConsumerOf, app not UTF-8", func() error {
			_, err := e.client.ConsumerOf(e.ctx, "sh\xffop", "orders")
			return err
		}, bellhop.ErrUnknownApp},
		{"ConsumerOf, queue with NUL", func() error {
			_, err := e.client.ConsumerOf(e.ctx, "shop", "ord\x00ers")
			return err
		}, bellhop.ErrInvalidQueueName},
		{"ConsumerOf, invalid queue name", func() error {
			_, err := e.client.ConsumerOf(e.ctx, "shop", "bad queue!")
			return err
		}, bellhop.ErrInvalidQueueName},
		{"ConsumerOf, unknown app", func() error {
			_, err := e.client.ConsumerOf(e.ctx, "no-such-app", "orders")
			return err
		}, bellhop.ErrUnknownApp},
		{"ConsumerOf, queue with no consumer", func() error {
			_, err := e.client.ConsumerOf(e.ctx, "shop", "other")
			return err
		}, bellhop.ErrUnknownConsumer},
	} {
		if err := c.call(); !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
	if after := e.tableState("queue_messages"); after != before {
		t.Error("queue_messages changed")
	}
	// Escaped once, not twice ("sh\\x00op").
	_, err = e.client.Enqueue(e.ctx, "sh\x00op", "orders", []byte(`1`), bellhop.EnqueueOptions{})
	if want := `unknown app "sh\x00op"`; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("Enqueue to app \"sh\\x00op\": %v, want %q", err, want)
	}
}

// TestZeroMux: like net/http's ServeMux, a zero Mux is ready to use, and
// a nil handler is refused when registered, not found at delivery. It
// does not serve a consumer with a URL.
func TestZeroMux(t *testing.T) {
	var m bellhop.Mux
	h := bellhop.HandlerFunc(func(context.Context, *bellhop.Message) error { return nil })
	m.Handle("shop", "orders", h)
	if m.Resolve(bellhop.Consumer{App: "shop", Queue: "orders"}) == nil {
		t.Error("the zero Mux lost its handler")
	}
	// A consumer with a URL is an HTTP endpoint's: the Mux leaves it to
	// the daemon's push, whatever it has for the queue.
	if m.Resolve(bellhop.Consumer{App: "shop", Queue: "orders", URL: "https://orders.example.com/hook"}) != nil {
		t.Error("the Mux serves an HTTP push consumer with a Go handler")
	}
	// A second Handle of the same queue replaces the first.
	first, second := &namedHandler{"first"}, &namedHandler{"second"}
	m.Handle("shop", "twice", first)
	m.Handle("shop", "twice", second)
	if got := m.Resolve(bellhop.Consumer{App: "shop", Queue: "twice"}); got != bellhop.Handler(second) {
		t.Errorf("after two Handles the Mux resolves %p, want the second, %p (first %p)", got, second, first)
	}
	for name, nilH := range map[string]bellhop.Handler{"nil": nil, "nil HandlerFunc": bellhop.HandlerFunc(nil)} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("Handle with a %s handler did not panic", name)
				}
			}()
			m.Handle("shop", "other", nilH)
		}()
	}
}

// waitUntil polls cond until it holds or d passes.
func waitUntil(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

var _ = pgtest.ConnString

// TestPrincipalExists: a second principal of the same name in an app is
// ErrPrincipalExists, testable with errors.Is like ErrAppExists; it was
// text only.
func TestPrincipalExists(t *testing.T) {
	e := fxNew(t)
	e.app("shop")
	if _, err := e.client.CreatePrincipal(e.ctx, "shop", "worker"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.client.CreatePrincipal(e.ctx, "shop", "worker"); !errors.Is(err, bellhop.ErrPrincipalExists) {
		t.Errorf("second principal of the same name: %v, want ErrPrincipalExists", err)
	}
}

// TestNamesNoneCanHave: an app or principal name that breaks the naming
// rules is still ErrUnknownApp or ErrUnknownPrincipal, and the error says
// why no such app or principal can exist; a well-formed name that is
// simply not there gets no such hint. It read as a plain "unknown app".
func TestNamesNoneCanHave(t *testing.T) {
	e := fxNew(t)
	shop := e.app("shop")
	enqueue := func(app string) func() error {
		return func() error {
			_, err := e.client.Enqueue(e.ctx, app, "orders", []byte(`1`), bellhop.EnqueueOptions{})
			return err
		}
	}
	register := func(c *bellhop.Client, principal string) func() error {
		return func() error {
			_, err := c.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders", Principal: principal})
			return err
		}
	}
	asShop := e.client.As(shop.DefaultPrincipal)
	const rule = "use 1 to 63 bytes of [A-Za-z0-9._-], starting with a letter or digit"
	for _, tc := range []struct {
		name string
		call func() error
		want error
		text string // in the error
		hint bool   // the error explains the naming rule
	}{
		{"empty app", enqueue(""), bellhop.ErrUnknownApp, `unknown app "" (not a valid app name: ` + rule + ")", true},
		{"app with a space", enqueue("bad name"), bellhop.ErrUnknownApp, `unknown app "bad name" (not a valid app name: `, true},
		{"app too long", enqueue(strings.Repeat("a", 64)), bellhop.ErrUnknownApp, "(not a valid app name: ", true},
		{"absent app", enqueue("nosuch"), bellhop.ErrUnknownApp, `unknown app "nosuch"`, false},
		{"principal with a slash", register(e.client, "ops/1"), bellhop.ErrUnknownPrincipal, `unknown principal "ops/1" in app "shop" (not a valid principal name: `, true},
		{"absent principal", register(e.client, "ghost"), bellhop.ErrUnknownPrincipal, `unknown principal "ghost" in app "shop"`, false},
		// Acting as a principal, naming another is forbidden; naming one
		// that cannot exist is the bad name it is.
		{"principal with a slash, as a principal", register(asShop, "ops/1"), bellhop.ErrUnknownPrincipal, "(not a valid principal name: ", true},
		{"another principal, as a principal", register(asShop, "ghost"), bellhop.ErrForbidden, `cannot act as principal "ghost"`, false},
		{"principal of a bad app name", func() error {
			_, err := e.client.CreatePrincipal(e.ctx, "-shop", "ops")
			return err
		}, bellhop.ErrUnknownApp, `create principal "ops": unknown app "-shop" (not a valid app name: `, true},
		// Creating one, a bad name is what it is.
		{"create app with a bad name", func() error {
			_, err := e.client.CreateApp(e.ctx, "bad name")
			return err
		}, bellhop.ErrInvalidName, `create app: invalid name: app name "bad name": ` + rule, false},
		{"create principal with a bad name", func() error {
			_, err := e.client.CreatePrincipal(e.ctx, "shop", "ops/1")
			return err
		}, bellhop.ErrInvalidName, `create principal: invalid name: principal name "ops/1": ` + rule, false},
	} {
		err := tc.call()
		if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.text) {
			t.Errorf("%s: %v, want %v saying %q", tc.name, err, tc.want, tc.text)
			continue
		}
		if got := strings.Contains(err.Error(), "not a valid"); got != tc.hint {
			t.Errorf("%s: %v: naming rule given %t, want %t", tc.name, err, got, tc.hint)
		}
	}
	if n := e.int64(`SELECT (SELECT count(*) FROM queue_messages) + (SELECT count(*) FROM queue_consumers)`); n != 0 {
		t.Errorf("%d rows written", n)
	}
}

// nilishResolver serves "served" with a real handler, returns a nil
// pointer and a nil HandlerFunc inside the Handler interface for two
// queues, and panics for a third.
type nilishResolver struct{ served bellhop.Handler }

type ptrHandler struct{ n int }

func (h *ptrHandler) Handle(context.Context, *bellhop.Message) error { h.n++; return nil }

func (r nilishResolver) Resolve(c bellhop.Consumer) bellhop.Handler {
	switch c.Queue {
	case "served":
		return r.served
	case "nil-pointer":
		var h *ptrHandler
		return h
	case "nil-func":
		var f bellhop.HandlerFunc
		return f
	case "panics":
		// With the consumer, whose signing secret the log must not show.
		panic(c)
	}
	return nil
}

// TestNilishHandlersServeNothing: a Resolver's nil pointer or nil
// HandlerFunc, and a Resolver's panic, mean "not served here", as a nil
// Handler does: the message stays for another dispatcher. The nil ones
// panicked on every delivery, spending attempts until the message was
// dead-lettered, and the panic crashed the process.
func TestNilishHandlersServeNothing(t *testing.T) {
	e := fxNew(t)
	e.app("shop")
	queues := []string{"nil-pointer", "nil-func", "panics", "served"}
	var secret string
	for _, q := range queues {
		spec := bellhop.ConsumerSpec{App: "shop", Queue: q}
		if q == "panics" {
			spec.URL = "http://127.0.0.1:9/hook" // a push consumer: its Resolver gets the secret
		}
		c, err := e.client.RegisterConsumer(e.ctx, spec)
		if err != nil {
			t.Fatal(err)
		}
		if q == "panics" {
			secret = c.Secret
		}
		if _, err := e.client.Enqueue(e.ctx, "shop", q, []byte(`1`), bellhop.EnqueueOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	var served atomic.Int32
	logs := &lineLog{}
	runDispatcher(t, e.pool.Config().ConnString(), nilishResolver{bellhop.HandlerFunc(func(context.Context, *bellhop.Message) error {
		served.Add(1)
		return nil
	})}, func(dc *bellhop.DispatcherConfig) {
		dc.Logger = zerolog.New(io.MultiWriter(logs, zerolog.NewTestWriter(t)))
	})
	waitUntil(t, 10*time.Second, "the served queue's first message", func() bool { return served.Load() == 1 })
	// One more round trip of the served queue: the others' lanes, woken
	// with it at the start, have had their turn.
	if _, err := e.client.Enqueue(e.ctx, "shop", "served", []byte(`2`), bellhop.EnqueueOptions{}); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 10*time.Second, "the served queue's second message", func() bool { return served.Load() == 2 })
	if n := e.int64(`SELECT count(*) FROM queue_messages WHERE attempt = 0 AND claim_token IS NULL`); n != 3 {
		t.Errorf("%d of the 3 unserved messages are untouched", n)
	}
	if n := e.int64(`SELECT count(*) FROM dead_letters`); n != 0 {
		t.Errorf("%d dead letters", n)
	}
	waitUntil(t, 10*time.Second, "the Resolver's panic logged", func() bool { return strings.Contains(logs.String(), "the Resolver panicked") })
	if l := logs.String(); !strings.Contains(l, "Queue:panics") || strings.Contains(l, secret) {
		t.Errorf("want the Resolver's panic value logged without the consumer's secret; logs:\n%s", l)
	}
}

// TestResolverPanicLoggedOnce: a Resolver that panics for a consumer is
// logged at error once, not on every reload (here, three other consumers
// registered), and again when its panic changes. It was logged on every
// reload, for every such consumer.
func TestResolverPanicLoggedOnce(t *testing.T) {
	e := fxNew(t)
	e.app("shop")
	if _, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "panics"}); err != nil {
		t.Fatal(err)
	}
	r := &panickyResolver{value: "first"}
	logs := &lineLog{}
	runDispatcher(t, e.pool.Config().ConnString(), r, func(dc *bellhop.DispatcherConfig) {
		dc.Logger = zerolog.New(io.MultiWriter(logs, zerolog.NewTestWriter(t))).Level(zerolog.InfoLevel)
	})
	for i := range 3 {
		if _, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: fmt.Sprintf("other%d", i)}); err != nil {
			t.Fatal(err)
		}
		waitUntil(t, 10*time.Second, fmt.Sprintf("reload %d", i+1), func() bool { return r.calls.Load() >= int32(i+2) })
	}
	if n := strings.Count(logs.String(), "the Resolver panicked"); n != 1 {
		t.Errorf("%d lines for a Resolver that panicked on 4 loads, want 1:\n%s", n, logs.String())
	}
	r.mu.Lock()
	r.value = "second"
	r.mu.Unlock()
	if _, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "other3"}); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 10*time.Second, "the changed panic logged", func() bool { return strings.Contains(logs.String(), `"panic":"second"`) })
	if l := logs.String(); strings.Count(l, "the Resolver panicked") != 2 || !strings.Contains(l, `"level":"error"`) {
		t.Errorf("want 2 error lines, one per panic value:\n%s", l)
	}
}

// panickyResolver panics with value for the consumer of queue panics,
// counting those calls; it serves no other consumer.
type panickyResolver struct {
	calls atomic.Int32
	mu    sync.Mutex
	value string
}

func (r *panickyResolver) Resolve(c bellhop.Consumer) bellhop.Handler {
	if c.Queue != "panics" {
		return nil
	}
	r.calls.Add(1)
	r.mu.Lock()
	v := r.value
	r.mu.Unlock()
	panic(v)
}

// TestHandBuiltPoolConfig: a pool config not made by pgxpool.ParseConfig
// makes Run return an error that says so; pgxpool panicked.
func TestHandBuiltPoolConfig(t *testing.T) {
	e := fxNew(t)
	cc, err := pgx.ParseConfig(e.pool.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	d, err := bellhop.NewDispatcher(&pgxpool.Config{ConnConfig: cc, MaxConns: 4}, bellhop.DispatcherConfig{Resolver: bellhop.NewMux()})
	if err != nil {
		t.Fatal(err)
	}
	err = d.Run(e.ctx)
	if !errors.Is(err, bellhop.ErrInvalidOptions) || !strings.Contains(err.Error(), "pgxpool.ParseConfig") {
		t.Errorf("Run with a hand-built pool config: %v; want ErrInvalidOptions naming pgxpool.ParseConfig", err)
	}
}

// TestNewDispatcherRefusesBadConfig: a negative duration, or one out of
// range, is refused with ErrInvalidOptions, naming the field. Negative
// durations were taken for the default, a 1ns PollInterval polled a
// thousand times a second, and a 1.5s visibility timeout became 1s.
func TestNewDispatcherRefusesBadConfig(t *testing.T) {
	t.Parallel()
	cfg, err := pgxpool.ParseConfig("postgres://u@127.0.0.1:1/db")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		dc   bellhop.DispatcherConfig
		want string
	}{
		{"negative PollInterval", bellhop.DispatcherConfig{PollInterval: -time.Second}, "PollInterval (-1s) must not be negative"},
		{"1ns PollInterval", bellhop.DispatcherConfig{PollInterval: time.Nanosecond}, "PollInterval (1ns) must be at least 100ms"},
		{"negative ShutdownGrace", bellhop.DispatcherConfig{ShutdownGrace: -time.Second}, "ShutdownGrace (-1s) must not be negative"},
		// Far past it, the stop's bound overflowed, and the stop gave up
		// on every outcome at once.
		{"ShutdownGrace past 12h", bellhop.DispatcherConfig{ShutdownGrace: 12*time.Hour + time.Second}, "ShutdownGrace (12h0m1s) must be at most 12h0m0s"},
		{"negative ReconnectDelay", bellhop.DispatcherConfig{ReconnectDelay: -time.Second}, "ReconnectDelay (-1s)"},
		{"negative HeartbeatTimeout", bellhop.DispatcherConfig{HeartbeatTimeout: -time.Second}, "HeartbeatTimeout (-1s)"},
		{"fractional visibility timeout", bellhop.DispatcherConfig{DefaultVisibilityTimeout: 1500 * time.Millisecond}, "DefaultVisibilityTimeout (1.5s) must be a whole number of seconds"},
		{"negative StatementTimeout", bellhop.DispatcherConfig{StatementTimeout: -time.Second}, "StatementTimeout (-1s) must not be negative"},
		{"10ms StatementTimeout", bellhop.DispatcherConfig{StatementTimeout: 10 * time.Millisecond}, "StatementTimeout (10ms) must be at least 100ms"},
		{"BusyLease at its minimum, default window", bellhop.DispatcherConfig{BusyLease: 10 * time.Millisecond}, "BusyWindow (4ms, the default) must be at most a quarter of BusyLease (10ms)"},
		// A 100-year visibility timeout overflowed the int4 seconds that
		// reclaim passes and polls send: every one of them failed. A 30-day
		// BusyLease overflowed idle_session_timeout: no busy key was held.
		{"100-year visibility timeout", bellhop.DispatcherConfig{DefaultVisibilityTimeout: 100 * 365 * 24 * time.Hour}, "must be a whole number of seconds, 1s to 12h0m0s"},
		{"visibility timeout over 12h", bellhop.DispatcherConfig{DefaultVisibilityTimeout: 12*time.Hour + time.Second}, "DefaultVisibilityTimeout (12h0m1s)"},
		{"30-day BusyLease", bellhop.DispatcherConfig{BusyLease: 30 * 24 * time.Hour}, "BusyLease (720h0m0s) must be 10ms to 1h"},
		{"BusyLease below 10ms", bellhop.DispatcherConfig{BusyLease: 9 * time.Millisecond, BusyWindow: time.Millisecond}, "BusyLease (9ms) must be 10ms to 1h"},
		// A 1ns heartbeat timeout reconnected the listener on every
		// heartbeat; a 1ns reconnect delay retried a down server without pause.
		{"1ns HeartbeatTimeout", bellhop.DispatcherConfig{HeartbeatTimeout: time.Nanosecond}, "HeartbeatTimeout (1ns) must be at least 100ms"},
		{"1ns ReconnectDelay", bellhop.DispatcherConfig{ReconnectDelay: time.Nanosecond}, "ReconnectDelay (1ns) must be at least 50ms"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.dc.Resolver = bellhop.NewMux()
			_, err := bellhop.NewDispatcher(cfg, tc.dc)
			if !errors.Is(err, bellhop.ErrInvalidOptions) || !strings.Contains(fmt.Sprint(err), tc.want) {
				t.Errorf("NewDispatcher: %v; want ErrInvalidOptions saying %q", err, tc.want)
			}
		})
	}
	// The limits themselves are accepted.
	if _, err := bellhop.NewDispatcher(cfg, bellhop.DispatcherConfig{Resolver: bellhop.NewMux(), PollInterval: 100 * time.Millisecond,
		DefaultVisibilityTimeout: time.Second, BusyLease: 16 * time.Millisecond, StatementTimeout: 100 * time.Millisecond,
		ReconnectDelay: 50 * time.Millisecond, HeartbeatTimeout: 100 * time.Millisecond}); err != nil {
		t.Errorf("NewDispatcher at the lower limits: %v", err)
	}
	if _, err := bellhop.NewDispatcher(cfg, bellhop.DispatcherConfig{Resolver: bellhop.NewMux(),
		DefaultVisibilityTimeout: 12 * time.Hour, BusyLease: time.Hour}); err != nil {
		t.Errorf("NewDispatcher at the upper limits: %v", err)
	}
	// A missing Resolver or pool config is a bad option too; a typed nil
	// Resolver, such as a nil *Mux, panicked on every consumer instead.
	var nilMux *bellhop.Mux
	for _, tc := range []struct {
		name string
		pc   *pgxpool.Config
		r    bellhop.Resolver
		want string
	}{
		// An untyped nil is not printed: it read "(got <nil>(nil))".
		{"no Resolver", cfg, nil, "DispatcherConfig.Resolver is required: "},
		{"nil *Mux", cfg, nilMux, "DispatcherConfig.Resolver is required (got *bellhop.Mux(nil))"},
		{"no pool config", nil, bellhop.NewMux(), "a pool config is required"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := bellhop.NewDispatcher(tc.pc, bellhop.DispatcherConfig{Resolver: tc.r})
			if !errors.Is(err, bellhop.ErrInvalidOptions) || !strings.Contains(fmt.Sprint(err), tc.want) {
				t.Errorf("NewDispatcher: %v; want ErrInvalidOptions saying %q", err, tc.want)
			}
		})
	}
}

// TestZeroDispatcher: a Dispatcher not made by NewDispatcher does not
// run, and says why: Run returns ErrInvalidOptions saying so (it returned
// a recovered nil-pointer panic from pgxpool, about the pool config),
// every time, and Ready reports it once Run has failed. Its other methods
// return zeros: ListenerStats panicked on the missing listener.
func TestZeroDispatcher(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := &bellhop.Dispatcher{}
	if s := d.ListenerStats(); s != (notify.Stats{}) {
		t.Errorf("ListenerStats: %+v, want zeros", s)
	}
	if s := d.LeaseStats(); s != (bellhop.LeaseStats{}) {
		t.Errorf("LeaseStats: %+v, want zeros", s)
	}
	if err := d.Ready(ctx); err == nil || !strings.Contains(err.Error(), "not running") {
		t.Errorf("Ready before Run: %v, want \"dispatcher not running\"", err)
	}
	const want = "not made by NewDispatcher"
	for i := range 2 {
		if err := d.Run(ctx); !errors.Is(err, bellhop.ErrInvalidOptions) || !strings.Contains(err.Error(), want) {
			t.Errorf("Run #%d: %v; want ErrInvalidOptions saying %q", i+1, err, want)
		}
	}
	if err := d.Ready(ctx); err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("Ready after Run: %v; want it to say %q", err, want)
	}
}

// TestRetryAfterBounds: RetryAfter's delay is at least 0 and at most 10
// years, the longest delay Enqueue takes; a handler's 290-year retry
// parked its message past any horizon.
func TestRetryAfterBounds(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		d    time.Duration
		want string
	}{
		{-5 * time.Second, "retry after 0s"},
		{0, "retry after 0s"},
		{1500 * time.Millisecond, "retry after 1.5s"},
		{10 * 365 * 24 * time.Hour, "retry after 87600h0m0s"},
		{math.MaxInt64, "retry after 87600h0m0s"},
	} {
		if got := bellhop.RetryAfter(tt.d).Error(); got != tt.want {
			t.Errorf("RetryAfter(%s) = %q, want %q", tt.d, got, tt.want)
		}
	}
}

// namedHandler is a Handler with an identity, to compare.
type namedHandler struct{ name string }

func (h *namedHandler) Handle(context.Context, *bellhop.Message) error { return nil }

// TestPrintingHidesSecretsAndPayloads: a Consumer printed by fmt, in any
// verb, shows no signing secret (nor a rotation's previous one), and a
// Message no payload, for handlers
// and Resolvers that log or panic with them. A Message printed its
// payload's bytes, a Consumer its secret.
func TestPrintingHidesSecretsAndPayloads(t *testing.T) {
	t.Parallel()
	const secret, card = "s3cr3t-signing-key", "4111111111111111"
	const previous = "pr3vious-signing-key" // a rotation's, still signing
	c := bellhop.Consumer{ID: uuid.New(), App: "shop", Queue: "orders", URL: "http://h.example/hook", Secret: secret,
		PreviousSecret: previous, PreviousSecretUntil: time.Now().Add(time.Hour)}
	m := bellhop.Message{ID: uuid.New(), App: "shop", Queue: "orders", Attempt: 2, MaxAttempts: 5,
		Payload: json.RawMessage(`{"card":"` + card + `"}`)}
	payloadBytes := fmt.Sprint([]byte(m.Payload))
	// Every verb letter fmt knows, with flags and widths: String and
	// GoString alone covered %v, %s and %#v, and %d, %x, %t and the rest
	// printed the fields ("%!d(string=s3cr3t-signing-key)").
	//
	// %p is the exception fmt leaves no way around: it prints a pointer's
	// address (which shows nothing), but on a struct value it is a bad
	// verb, whose "%!p(...)" prints the fields without calling any
	// method, Format included. go vet reports that misuse; the README
	// names it.
	hexCard := fmt.Sprintf("%x", card)
	var verbs []string
	for _, letter := range "vsqxXdtbcoOUeEfFgGp" {
		for _, flags := range []string{"", "+", "#", "+#", "-", "30", "-30", "+#30", ".1000"} {
			verbs = append(verbs, "%"+flags+string(letter))
		}
	}
	for _, verb := range verbs {
		isP := strings.HasSuffix(verb, "p")
		for _, v := range []any{c, &c} {
			if _, ptr := v.(*bellhop.Consumer); isP && !ptr {
				continue
			}
			got := fmt.Sprintf(verb, v)
			if strings.Contains(got, secret) || strings.Contains(got, fmt.Sprintf("%x", secret)) {
				t.Errorf("Sprintf(%q, %T) = %s; shows the secret", verb, v, got)
			}
			if strings.Contains(got, previous) || strings.Contains(got, fmt.Sprintf("%x", previous)) {
				t.Errorf("Sprintf(%q, %T) = %s; shows the previous secret", verb, v, got)
			}
			if !isP && (!strings.Contains(got, "xxxxx") || !strings.Contains(got, "orders")) {
				t.Errorf("Sprintf(%q, %T) = %s; want the queue and a placeholder", verb, v, got)
			}
		}
		for _, v := range []any{m, &m} {
			if _, ptr := v.(*bellhop.Message); isP && !ptr {
				continue
			}
			got := fmt.Sprintf(verb, v)
			if strings.Contains(got, card) || strings.Contains(got, payloadBytes[1:20]) || strings.Contains(got, hexCard) {
				t.Errorf("Sprintf(%q, %T) = %s; shows the payload", verb, v, got)
			}
			if !isP && !strings.Contains(got, m.ID.String()) {
				t.Errorf("Sprintf(%q, %T) = %s; want the id", verb, v, got)
			}
		}
	}
	// The directive's width applies to the description, as to a string.
	if got, want := fmt.Sprintf("%-120v|", m), fmt.Sprintf("%-120s|", m.String()); got != want {
		t.Errorf("Sprintf(%%-120v, Message) = %q, want %q", got, want)
	}
	if got, want := fmt.Sprintf("%q", &c), fmt.Sprintf("%q", c.String()); got != want {
		t.Errorf("Sprintf(%%q, *Consumer) = %s, want %s", got, want)
	}
	if got, want := fmt.Sprintf("%#v", m), m.GoString(); got != want {
		t.Errorf("Sprintf(%%#v, Message) = %q, want %q", got, want)
	}
	if got, want := m.String(), fmt.Sprintf("message %s of shop/orders, attempt 2 of 5, %d payload bytes", m.ID, len(m.Payload)); got != want {
		t.Errorf("Message.String() = %q, want %q", got, want)
	}
	// A Consumer without a secret shows no placeholder for one.
	if got := fmt.Sprint(bellhop.Consumer{Queue: "orders"}); strings.Contains(got, "xxxxx") {
		t.Errorf("a Consumer with no secret prints %s", got)
	}
}

// TestJSONHidesConsumerSecret: a Consumer encoded as JSON, by
// encoding/json or by the JSON loggers that use it (zerolog's Interface,
// log/slog's JSONHandler), leaves its signing secret out and keeps its
// other fields, for Resolvers that log one. Only fmt hid the secret: JSON
// showed it in full. A Message keeps its payload in JSON (a handler may
// forward it), as the README says.
func TestJSONHidesConsumerSecret(t *testing.T) {
	t.Parallel()
	const secret, previous = "s3cr3t-signing-key", "pr3vious-signing-key"
	c := bellhop.Consumer{ID: uuid.New(), App: "shop", Queue: "orders", URL: "http://h.example/hook", Secret: secret,
		PreviousSecret: previous, PreviousSecretUntil: time.Now().Add(time.Hour)}
	var zl, sl strings.Builder
	zlog := zerolog.New(&zl)
	zlog.Info().Interface("consumer", c).Send()
	slog.New(slog.NewJSONHandler(&sl, nil)).Info("resolved", "consumer", &c)
	outs := map[string]string{"zerolog Interface": zl.String(), "slog JSONHandler": sl.String()}
	for _, v := range []any{c, &c} {
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatalf("json.Marshal(%T): %v", v, err)
		}
		outs[fmt.Sprintf("json.Marshal(%T)", v)] = string(b)
	}
	for how, got := range outs {
		if strings.Contains(got, secret) || strings.Contains(got, `"Secret"`) || !strings.Contains(got, c.ID.String()) || !strings.Contains(got, "http://h.example/hook") {
			t.Errorf("%s = %s; want the id and URL, and no secret", how, got)
		}
		if strings.Contains(got, previous) || strings.Contains(got, `"PreviousSecret"`) || !strings.Contains(got, `"PreviousSecretUntil"`) {
			t.Errorf("%s = %s; want the previous secret's end, and not the secret", how, got)
		}
	}
	// With no rotation under way, no zero time either.
	if b, err := json.Marshal(bellhop.Consumer{Queue: "orders"}); err != nil || strings.Contains(string(b), "PreviousSecretUntil") {
		t.Errorf("json.Marshal(Consumer with no previous secret) = %s, %v; want no PreviousSecretUntil", b, err)
	}
	m := bellhop.Message{ID: uuid.New(), Payload: json.RawMessage(`{"card":"4111"}`)}
	if b, err := json.Marshal(m); err != nil || !strings.Contains(string(b), `"Payload":{"card":"4111"}`) {
		t.Errorf("json.Marshal(Message) = %s, %v; want the payload kept", b, err)
	}
}

// TestNilPoolAndTransaction: a nil pool is refused by NewClient, with a
// message that names it, rather than by a nil-pointer panic in the first
// method called; a nil transaction is an error of EnqueueTx and
// EnqueueManyTx, not a panic.
func TestNilPoolAndTransaction(t *testing.T) {
	func() {
		defer func() {
			if r := recover(); r == nil || !strings.Contains(fmt.Sprint(r), "NewClient: nil pool") {
				t.Errorf("NewClient(nil) recovered %v, want a panic naming the nil pool", r)
			}
		}()
		bellhop.NewClient(nil)
	}()
	e := fxNew(t)
	e.app("shop")
	before := e.tableState("queue_messages")
	if _, err := e.client.EnqueueTx(e.ctx, nil, "shop", "orders", []byte(`1`), bellhop.EnqueueOptions{}); !errors.Is(err, bellhop.ErrInvalidOptions) || !strings.Contains(fmt.Sprint(err), "nil transaction") {
		t.Errorf("EnqueueTx(nil tx): %v, want ErrInvalidOptions naming the nil transaction", err)
	}
	var tx pgx.Tx
	if _, err := e.client.EnqueueManyTx(e.ctx, tx, "shop", []bellhop.NewMessage{{Queue: "orders", Payload: []byte(`1`)}}); !errors.Is(err, bellhop.ErrInvalidOptions) || !strings.Contains(fmt.Sprint(err), "nil transaction") {
		t.Errorf("EnqueueManyTx(nil tx): %v, want ErrInvalidOptions naming the nil transaction", err)
	}
	if after := e.tableState("queue_messages"); after != before {
		t.Error("queue_messages changed")
	}
}

// nilObserver is an Observer whose nil pointer panics when called.
type nilObserver struct{ n int }

func (o *nilObserver) Delivered(*bellhop.Message)                               { o.n++ }
func (o *nilObserver) Settled(*bellhop.Message, bellhop.Outcome, time.Duration) { o.n++ }
func (o *nilObserver) Polled(int)                                               { o.n++ }
func (o *nilObserver) Reclaimed(int64, int64)                                   { o.n++ }
func (o *nilObserver) Finished(*bellhop.Message)                                { o.n++ }

// TestTypedNilObserver: a nil pointer as the Observer is refused by
// NewDispatcher. Accepted, it crashed the process at the first delivery,
// on a goroutine of the dispatcher's.
func TestTypedNilObserver(t *testing.T) {
	t.Parallel()
	cfg, err := pgxpool.ParseConfig("postgres://u@127.0.0.1:1/db")
	if err != nil {
		t.Fatal(err)
	}
	var obs *nilObserver
	_, err = bellhop.NewDispatcher(cfg, bellhop.DispatcherConfig{Resolver: bellhop.NewMux(), Observer: obs})
	if !errors.Is(err, bellhop.ErrInvalidOptions) || !strings.Contains(fmt.Sprint(err), "Observer is a *bellhop_test.nilObserver(nil)") {
		t.Errorf("NewDispatcher with a nil *nilObserver: %v, want ErrInvalidOptions naming it", err)
	}
}

// oneOrder registers a consumer of shop/orders, served by h through a new
// Dispatcher with cfg, runs it (stoppable), enqueues one message and
// returns the dispatcher, the message's id and stop.
func oneOrder(t *testing.T, e *fxEnv, h bellhop.HandlerFunc, cfg bellhop.DispatcherConfig) (*bellhop.Dispatcher, uuid.UUID, func() error) {
	t.Helper()
	e.app("shop")
	if _, err := e.client.RegisterConsumer(e.ctx, bellhop.ConsumerSpec{App: "shop", Queue: "orders"}); err != nil {
		t.Fatal(err)
	}
	mux := bellhop.NewMux()
	mux.Handle("shop", "orders", h)
	cfg.Resolver, cfg.PollInterval = mux, time.Hour
	cfg.Logger = zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.WarnLevel)
	d, err := bellhop.NewDispatcher(e.pool.Config().Copy(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Ready(e.ctx); err == nil || !strings.Contains(err.Error(), "not running") {
		t.Errorf("Ready before Run: %v, want \"dispatcher not running\"", err)
	}
	stop := stoppable(t, e.ctx, d)
	id, err := e.client.Enqueue(e.ctx, "shop", "orders", []byte(`1`), bellhop.EnqueueOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return d, id, stop
}

// TestAfterRun: before Run, Ready says the dispatcher is not running;
// once Run has returned, that it has stopped (it said the listener was
// not connected), and a renewal by a goroutine that a handler left
// behind fails with ErrLeaseLost without a statement (it failed with
// "closed pool").
func TestAfterRun(t *testing.T) {
	e := fxNew(t)
	handled := make(chan *bellhop.Message, 1)
	d, _, stop := oneOrder(t, e, func(_ context.Context, m *bellhop.Message) error {
		handled <- m
		return nil
	}, bellhop.DispatcherConfig{})
	var m *bellhop.Message
	select {
	case m = <-handled:
	case <-time.After(10 * time.Second):
		t.Fatal("no delivery")
	}
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if err := d.Ready(e.ctx); err == nil || !strings.Contains(err.Error(), "dispatcher stopped") {
		t.Errorf("Ready after Run returned: %v, want \"dispatcher stopped\"", err)
	}
	if err := m.ExtendLease(e.ctx); !errors.Is(err, bellhop.ErrLeaseLost) {
		t.Errorf("ExtendLease after the handler and Run returned: %v, want ErrLeaseLost", err)
	}
}

// TestReadyAfterFailedStart: when Run cannot start (here the schema is
// older than the code), Ready says so, with Run's error, rather than that
// Run's context ended, which it never did. Found by review.
func TestReadyAfterFailedStart(t *testing.T) {
	e := fxNew(t)
	if _, err := e.pool.Exec(e.ctx, "UPDATE "+migrations.VersionTable+" SET version = version - 1"); err != nil {
		t.Fatal(err)
	}
	d, err := bellhop.NewDispatcher(e.pool.Config().Copy(), bellhop.DispatcherConfig{Resolver: bellhop.NewMux(), Logger: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Run(e.ctx); !errors.Is(err, migrations.ErrSchemaBehind) {
		t.Fatalf("Run on an older schema: %v, want ErrSchemaBehind", err)
	}
	if err := d.Ready(e.ctx); !errors.Is(err, migrations.ErrSchemaBehind) || !strings.Contains(err.Error(), "could not start") {
		t.Errorf("Ready after Run failed to start: %v, want \"dispatcher could not start\" wrapping ErrSchemaBehind", err)
	}
}

// TestPermanentCancellationAtStop: a handler cut off by a stop's grace
// that returns Permanent(ctx.Err()) has its message released, attempt
// refunded, as for any error it returns then: the failure is the stop's,
// not the message's. It was dead-lettered.
func TestPermanentCancellationAtStop(t *testing.T) {
	e := fxNew(t)
	started := make(chan struct{}, 1)
	_, id, stop := oneOrder(t, e, func(ctx context.Context, _ *bellhop.Message) error {
		started <- struct{}{}
		<-ctx.Done()
		return bellhop.Permanent(ctx.Err())
	}, bellhop.DispatcherConfig{ShutdownGrace: 200 * time.Millisecond})
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("no delivery")
	}
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	var attempt int
	var token *uuid.UUID
	if err := e.pool.QueryRow(e.ctx, `SELECT attempt, claim_token FROM queue_messages WHERE id = $1`, id).Scan(&attempt, &token); err != nil {
		var dead int
		_ = e.pool.QueryRow(e.ctx, `SELECT count(*) FROM dead_letters WHERE id = $1`, id).Scan(&dead)
		t.Fatalf("the message is not in queue_messages: %v (dead letters with its id: %d)", err, dead)
	}
	if attempt != 0 || token != nil {
		t.Errorf("after the stop: attempt %d, claim_token %v; want 0 and NULL (released, refunded)", attempt, token)
	}
}
