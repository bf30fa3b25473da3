package integration

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/bellhopq/bellhop"
	queries "github.com/bellhopq/bellhop/sql"
)

// pollObserver counts fallback polls and the missed work they report.
type pollObserver struct{ polls, missed atomic.Int64 }

func (o *pollObserver) Delivered(*bellhop.Message)                               {}
func (o *pollObserver) Settled(*bellhop.Message, bellhop.Outcome, time.Duration) {}
func (o *pollObserver) Reclaimed(int64, int64)                                   {}
func (o *pollObserver) Finished(*bellhop.Message)                                {}
func (o *pollObserver) Polled(missed int) {
	o.polls.Add(1)
	o.missed.Add(int64(missed))
}

// TestFallbackPollFindsMissedWork: a message whose notification never
// came (the trigger disabled, as if the notification were lost) is found
// by the fallback poll, delivered, and reported as missed once it has
// been ready for a second or more; one that came due less than a second
// before the poll, queue message or invoke delivery, is delivered but not
// reported (another dispatcher's timer may be taking it at that moment);
// polls that find nothing report nothing. A message claimed long ago
// (a long handler elsewhere) is not missed work, whatever else is ready.
func TestFallbackPollFindsMissedWork(t *testing.T) {
	e := newEnv(t)
	// A lease that outlasts the test: the claimed message below stays
	// claimed.
	cons := e.consumer(t, bellhop.ConsumerSpec{Queue: "orders", VisibilityTimeout: time.Hour})
	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	obs := &pollObserver{}
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, Observer: obs, PollInterval: time.Second}, nil)

	waitFor(t, 5*time.Second, "a poll with nothing to find", func() bool { return obs.polls.Load() >= 1 })
	if m := obs.missed.Load(); m != 0 {
		t.Fatalf("idle polls reported %d missed queues", m)
	}
	ctx := context.Background()
	// unannounced enqueues a message without its notification.
	unannounced := func(opts bellhop.EnqueueOptions) uuid.UUID {
		t.Helper()
		if _, err := e.pool.Exec(ctx, `ALTER TABLE queue_messages DISABLE TRIGGER queue_messages_notify`); err != nil {
			t.Fatal(err)
		}
		id := e.enqueue(t, "orders", map[string]string{"lost": "notification"}, opts)
		if _, err := e.pool.Exec(ctx, `ALTER TABLE queue_messages ENABLE TRIGGER queue_messages_notify`); err != nil {
			t.Fatal(err)
		}
		return id
	}

	// A message enqueued a minute ago and claimed since, as by another
	// dispatcher whose handler still runs: not ready, so never missed,
	// even beside the ready message below.
	claimed := e.enqueue(t, "orders", map[string]string{"long": "handler"}, bellhop.EnqueueOptions{Delay: time.Hour})
	if _, err := e.pool.Exec(ctx, `UPDATE queue_messages
		SET claim_token = gen_random_uuid(), claimed_at = now(), attempt = 1,
		    deliver_after = NULL, enqueued_at = now() - interval '1 minute'
		WHERE id = $1`, claimed); err != nil {
		t.Fatal(err)
	}

	// Due 200 ms after a poll: the next poll, 0.9 - 1.1 s after that
	// one, finds it due for less than a second.
	polls := obs.polls.Load()
	waitFor(t, 5*time.Second, "the next poll", func() bool { return obs.polls.Load() > polls })
	fresh := unannounced(bellhop.EnqueueOptions{Delay: 200 * time.Millisecond})
	waitFor(t, 5*time.Second, "the poll delivers the message that just came due", func() bool {
		d := rec.deliveries()
		return len(d) == 1 && d[0].ID == fresh
	})
	// The poll reports (Polled) after it has handed the message on, so it
	// may not have reported yet: wait for the next report, which is that
	// poll's or a later one's.
	polls = obs.polls.Load()
	waitFor(t, 5*time.Second, "the delivering poll's report", func() bool { return obs.polls.Load() > polls })
	if m := obs.missed.Load(); m != 0 {
		t.Fatalf("polls reported %d missed queues for work due under a second, want 0", m)
	}

	// The same for an invoke delivery: due 200 ms after a poll, without
	// its notification.
	polls = obs.polls.Load()
	waitFor(t, 5*time.Second, "the next poll", func() bool { return obs.polls.Load() > polls })
	if _, err := e.pool.Exec(ctx, `ALTER TABLE outbox DISABLE TRIGGER outbox_notify`); err != nil {
		t.Fatal(err)
	}
	freshInvoke, err := e.client.InvokeAsync(ctx, cons.ID, []byte(`{"lost":"notification"}`), bellhop.EnqueueOptions{Delay: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.pool.Exec(ctx, `ALTER TABLE outbox ENABLE TRIGGER outbox_notify`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the poll delivers the invoke delivery that just came due", func() bool {
		d := rec.deliveries()
		return len(d) == 2 && d[1].ID == freshInvoke && d[1].Invoked
	})
	polls = obs.polls.Load()
	waitFor(t, 5*time.Second, "the delivering poll's report", func() bool { return obs.polls.Load() > polls })
	if m := obs.missed.Load(); m != 0 {
		t.Fatalf("polls reported %d missed for an invoke delivery due under a second, want 0", m)
	}

	// Ready for a minute already (a deliver-after time in the past is
	// kept as given).
	stale := unannounced(bellhop.EnqueueOptions{DeliverAfter: time.Now().Add(-time.Minute)})
	waitFor(t, 5*time.Second, "the poll delivers the unannounced message", func() bool {
		d := rec.deliveries()
		return len(d) == 3 && d[2].ID == stale
	})
	// Its report may come after the delivery.
	waitFor(t, 5*time.Second, "a poll to report the unannounced message as missed", func() bool { return obs.missed.Load() >= 1 })
	if m := obs.missed.Load(); m != 1 {
		t.Fatalf("polls reported %d missed queues, want 1", m)
	}
}

// TestFallbackPollCountsMissedBesideDeliveries: a consumer's lanes share
// its in-flight slots, but a lane is idle when nothing of its own runs. An
// invoke delivery whose notification was lost is counted as missed while
// the same consumer's queue message is still being handled, with slots to
// spare.
func TestFallbackPollCountsMissedBesideDeliveries(t *testing.T) {
	e := newEnv(t)
	c := e.consumer(t, bellhop.ConsumerSpec{Queue: "orders", MaxInFlight: 10})
	started := make(chan struct{}, 1)
	release := make(chan struct{})
	rec := &recorder{result: func(ctx context.Context, m *bellhop.Message) error {
		if !m.Invoked {
			started <- struct{}{}
			<-release
		}
		return nil
	}}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	obs := &pollObserver{}
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, Observer: obs, PollInterval: time.Second}, nil)
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	t.Cleanup(free) // before the dispatcher's stop
	// The start-up wake scan (after the listener's first connect) runs
	// before the first poll, on the same goroutine: once a poll has run,
	// only a poll can find the unannounced delivery below.
	waitFor(t, 5*time.Second, "a first poll", func() bool { return obs.polls.Load() >= 1 })

	e.enqueue(t, "orders", map[string]string{"held": "open"}, bellhop.EnqueueOptions{})
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the queue message was not delivered")
	}
	ctx := context.Background()
	if _, err := e.pool.Exec(ctx, `ALTER TABLE outbox DISABLE TRIGGER outbox_notify`); err != nil {
		t.Fatal(err)
	}
	id, err := e.client.InvokeAsync(ctx, c.ID, []byte(`{"lost":"notification"}`),
		bellhop.EnqueueOptions{DeliverAfter: time.Now().Add(-time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.pool.Exec(ctx, `ALTER TABLE outbox ENABLE TRIGGER outbox_notify`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the poll delivers the unannounced invoke delivery", func() bool {
		for _, d := range rec.deliveries() {
			if d.ID == id {
				return true
			}
		}
		return false
	})
	// The poll reports after it has handed the delivery on.
	waitFor(t, 5*time.Second, "a poll to report the invoke delivery as missed (the invoke lane was idle beside the queue's delivery)",
		func() bool { return obs.missed.Load() >= 1 })
	if m := obs.missed.Load(); m != 1 {
		t.Errorf("polls reported %d missed, want 1: the invoke lane was idle beside the queue's delivery", m)
	}
	free()
}

// TestSlowPollNotTakenForHungListener: a fallback poll that waits longer
// than HeartbeatTimeout for a lock does not get the listener replaced as
// hung: the heartbeat it carries is timed from its commit, not from the
// start of the statement.
func TestSlowPollNotTakenForHungListener(t *testing.T) {
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders"})
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", &recorder{})
	obs := &pollObserver{}
	// A second, not less: every heartbeat of the test must come back in
	// time on a loaded machine.
	const timeout = time.Second
	d := startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, Observer: obs,
		PollInterval: 200 * time.Millisecond, HeartbeatTimeout: timeout}, nil)
	waitFor(t, 5*time.Second, "a poll", func() bool { return obs.polls.Load() >= 1 })

	ctx := context.Background()
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	// The poll reads queue_consumers: it waits until this transaction ends.
	if _, err := tx.Exec(ctx, `LOCK TABLE queue_consumers IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the poll waiting for the lock", func() bool {
		// The statement's text as sent, comment first, cut to what
		// pg_stat_activity keeps of it.
		return e.count(t, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'
			  AND left(query, 200) = left($1, 200)`, queries.Poll) >= 1
	})
	polls := obs.polls.Load()
	holdsFor(t, 3*timeout, "no hung restart while the poll waits", func() bool { return d.ListenerStats().HungRestarts == 0 })
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	heard := d.ListenerStats().Notifications
	waitFor(t, 5*time.Second, "the slow poll and the next one", func() bool { return obs.polls.Load() >= polls+2 })
	waitFor(t, 5*time.Second, "their heartbeat heard", func() bool { return d.ListenerStats().Notifications > heard })
	if st := d.ListenerStats(); st.HungRestarts != 0 || st.Connects != 1 {
		t.Errorf("listener stats %+v, want no missed heartbeat and one connect", st)
	}
}
