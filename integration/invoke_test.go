package integration

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/bellhopq/bellhop"
)

// TestInvokeAsync: the outbox arm. InvokeAsync reaches the consumer's
// handler as an invoked delivery, through the same claim, retry and
// dead-letter path as queue messages.
func TestInvokeAsync(t *testing.T) {
	e := newEnv(t)
	ok := e.consumer(t, bellhop.ConsumerSpec{Queue: "jobs"})
	failing := e.consumer(t, bellhop.ConsumerSpec{Queue: "flaky", MaxAttempts: 3,
		BackoffBase: 20 * time.Millisecond, BackoffCap: 100 * time.Millisecond})
	okRec := &recorder{}
	failRec := &recorder{result: func(context.Context, *bellhop.Message) error {
		return errors.New("invoke target refused")
	}}
	mux := bellhop.NewMux()
	mux.Handle("app", "jobs", okRec)
	mux.Handle("app", "flaky", failRec)
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour}, nil)
	ctx := context.Background()

	t.Run("delivered", func(t *testing.T) {
		payload := []byte(`{"job":"resize","n":7}`)
		id, err := e.client.InvokeAsync(ctx, ok.ID, payload, bellhop.EnqueueOptions{})
		if err != nil {
			t.Fatal(err)
		}
		waitFor(t, 5*time.Second, "the invoke delivery", func() bool { return okRec.n.Load() == 1 })
		d := okRec.deliveries()[0]
		if d.ID != id || !d.Invoked || d.Attempt != 1 {
			t.Errorf("got message %s invoked=%v attempt %d; want %s invoked=true attempt 1", d.ID, d.Invoked, d.Attempt, id)
		}
		var got, want any
		if err := json.Unmarshal(d.Payload, &got); err != nil {
			t.Fatal(err)
		}
		_ = json.Unmarshal(payload, &want)
		if b1, b2 := mustJSON(got), mustJSON(want); b1 != b2 {
			t.Errorf("payload %s, want %s", b1, b2)
		}
		waitFor(t, 5*time.Second, "the invoke delivery acked", func() bool {
			return e.count(t, `SELECT count(*) FROM outbox`) == 0
		})
	})

	t.Run("retried then dead-lettered", func(t *testing.T) {
		id, err := e.client.InvokeAsync(ctx, failing.ID, []byte(`"x"`), bellhop.EnqueueOptions{})
		if err != nil {
			t.Fatal(err)
		}
		waitFor(t, 5*time.Second, "the failing invoke delivery to be dead-lettered", func() bool {
			_, dead := e.deadLetterOf(t, id)
			return dead
		})
		calls := failRec.deliveries()
		if len(calls) != 3 {
			t.Fatalf("handler called %d times, want 3", len(calls))
		}
		for i, c := range calls {
			if c.ID != id || !c.Invoked || c.Attempt != i+1 {
				t.Errorf("call %d: %s invoked=%v attempt %d", i+1, c.ID, c.Invoked, c.Attempt)
			}
		}
		dl, _ := e.deadLetterOf(t, id)
		if dl.Source != "invoke" || dl.Queue != "flaky" || dl.TriggerID == nil || *dl.TriggerID != failing.ID {
			t.Errorf("dead letter %+v; want source invoke, queue flaky, trigger %s", dl, failing.ID)
		}
		checkDead(t, e, id, "invoke target refused", 3, 3)
		if n := e.count(t, `SELECT count(*) FROM outbox`); n != 0 {
			t.Errorf("%d outbox rows left", n)
		}
	})
}

func mustJSON(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return string(b)
}

// TestInvokeBesideQueueBacklog: at MaxInFlight 1, an invoke delivery and
// a queue backlog of the same consumer take turns at the slot. The queue
// lane, which freed the slot and was woken last, won nearly every race for
// it: the invoke waited for the whole backlog (2,900 messages, 8.6s).
// The bound on the queue messages delivered first was 20, and a loaded
// machine under -race saw 10; it is now a tenth of the backlog, far above
// a notification's round trips and far below the backlog.
func TestInvokeBesideQueueBacklog(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	cons := e.consumer(t, bellhop.ConsumerSpec{Queue: "orders", MaxInFlight: 1})
	const backlog = 1000
	if _, err := e.pool.Exec(ctx, `INSERT INTO queue_messages (app_id, queue_name, payload)
		SELECT id, 'orders', '{}' FROM apps, generate_series(1, $1::int)`, backlog); err != nil {
		t.Fatal(err)
	}
	rec := &recorder{result: func(context.Context, *bellhop.Message) error {
		time.Sleep(2 * time.Millisecond) // a handler's work
		return nil
	}}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour}, nil)
	waitFor(t, 10*time.Second, "the backlog under way", func() bool { return rec.n.Load() >= 20 })
	if _, err := e.client.InvokeAsync(ctx, cons.ID, []byte(`"now"`), bellhop.EnqueueOptions{}); err != nil {
		t.Fatal(err)
	}
	before := int(rec.n.Load())
	var at int
	waitFor(t, 30*time.Second, "the invoke delivery", func() bool {
		at = slices.IndexFunc(rec.deliveries(), func(d delivery) bool { return d.Invoked })
		return at >= 0
	})
	// Its notification takes a round trip or two; then it has the next
	// turn. Counted up to its own delivery (the slot runs one at a time),
	// not up to when the wait above saw it. Had it waited for the
	// backlog, the rest of it, over 900 messages, would count.
	ahead := at - before
	t.Logf("%d queue messages delivered between the invoke's send and its delivery, of a backlog of %d", ahead, backlog)
	if limit := backlog / 10; ahead >= limit {
		t.Errorf("%d queue messages were delivered before the invoke delivery; want fewer than %d of the backlog of %d", ahead, limit, backlog)
	}
}
