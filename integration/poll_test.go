package integration

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bellhopq/bellhop"
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
// by the fallback poll, delivered, and reported as missed; polls that find
// nothing report nothing.
func TestFallbackPollFindsMissedWork(t *testing.T) {
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders"})
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
	if _, err := e.pool.Exec(ctx, `ALTER TABLE queue_messages DISABLE TRIGGER queue_messages_notify`); err != nil {
		t.Fatal(err)
	}
	id := e.enqueue(t, "orders", map[string]string{"lost": "notification"}, bellhop.EnqueueOptions{})
	if _, err := e.pool.Exec(ctx, `ALTER TABLE queue_messages ENABLE TRIGGER queue_messages_notify`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the poll delivers the unannounced message", func() bool {
		d := rec.deliveries()
		return len(d) == 1 && d[0].ID == id
	})
	if m := obs.missed.Load(); m != 1 {
		t.Fatalf("polls reported %d missed queues, want 1", m)
	}
}
