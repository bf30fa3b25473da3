package integration

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/bellhopq/bellhop"
)

// TestOneConsumerPerQueue: of 10 concurrent registrations for one queue,
// exactly one wins and the other 9 get ErrConsumerExists. Several rounds,
// each on a fresh queue, give the race more chances to go wrong.
func TestOneConsumerPerQueue(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	const racers = 10
	for round := range 5 {
		queue := fmt.Sprintf("contested-%d", round)
		var start, done sync.WaitGroup
		start.Add(1)
		errs := make([]error, racers)
		for i := range racers {
			done.Go(func() {
				start.Wait()
				_, errs[i] = e.client.RegisterConsumer(ctx, bellhop.ConsumerSpec{App: "app", Queue: queue})
			})
		}
		start.Done()
		done.Wait()
		won, lost := 0, 0
		for _, err := range errs {
			switch {
			case err == nil:
				won++
			case errors.Is(err, bellhop.ErrConsumerExists):
				lost++
			default:
				t.Errorf("%s: unexpected error: %v", queue, err)
			}
		}
		if won != 1 || lost != racers-1 {
			t.Errorf("%s: %d registrations succeeded and %d got ErrConsumerExists; want 1 and %d", queue, won, lost, racers-1)
		}
		if n := e.count(t, `SELECT count(*) FROM queue_consumers WHERE queue_name = $1`, queue); n != 1 {
			t.Errorf("%s: %d consumers in the database, want 1", queue, n)
		}
	}
}

// disabledSeen is a Mux that notes when a reload first read consumer id
// disabled: a reload resolves every consumer, paused ones too, and then
// applies them all.
type disabledSeen struct {
	*bellhop.Mux
	id uuid.UUID
	mu sync.Mutex
	at time.Time
}

func (r *disabledSeen) Resolve(c bellhop.Consumer) bellhop.Handler {
	if c.ID == r.id && !c.Enabled {
		r.mu.Lock()
		if r.at.IsZero() {
			r.at = time.Now()
		}
		r.mu.Unlock()
	}
	return r.Mux.Resolve(c)
}

// seen returns when a reload first read the consumer disabled; zero if
// none has yet.
func (r *disabledSeen) seen() time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.at
}

// TestConsumerChange: disabling a consumer on a running dispatcher stops
// its deliveries once a reload has read the change, which its
// notification brings within seconds (the poll is an hour away), and
// enabling it again resumes them, without a restart. Another queue's
// consumer is unaffected. No delivery could start later than a second
// after the disable, which held the reload's own delay too (316ms seen on
// a loaded machine under -race); the second now runs from the reload.
func TestConsumerChange(t *testing.T) {
	e := newEnv(t)
	toggled := e.consumer(t, bellhop.ConsumerSpec{Queue: "toggled"})
	e.consumer(t, bellhop.ConsumerSpec{Queue: "other"})
	rec, other := &recorder{}, &recorder{}
	mux := &disabledSeen{Mux: bellhop.NewMux(), id: toggled.ID}
	mux.Handle("app", "toggled", rec)
	mux.Handle("app", "other", other)
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour}, nil)
	ctx := context.Background()

	e.enqueue(t, "toggled", "before", bellhop.EnqueueOptions{})
	waitFor(t, 5*time.Second, "delivery while enabled", func() bool { return rec.n.Load() == 1 })

	if err := e.client.SetConsumerEnabled(ctx, "app", toggled.ID, false); err != nil {
		t.Fatal(err)
	}
	disabled := time.Now()
	// The reload resolves the consumers before it applies them, and a
	// claim checked against the old state just before may still start
	// its delivery a moment after: grace allows for both.
	const grace = time.Second
	// Keep producing through the change: messages enqueued from grace
	// after the reload on must all wait.
	var ids []string
	var read time.Time
	pace := time.NewTicker(20 * time.Millisecond)
	for read.IsZero() || time.Since(read) < grace+500*time.Millisecond {
		if read = mux.seen(); read.IsZero() && time.Since(disabled) > 5*time.Second {
			t.Fatal("no reload read the disable within 5s of it: its notification was not heard")
		}
		ids = append(ids, e.enqueue(t, "toggled", len(ids), bellhop.EnqueueOptions{}).String())
		<-pace.C
	}
	pace.Stop()
	settle := read.Add(grace)
	holdsFor(t, 500*time.Millisecond, "no delivery to the disabled consumer", func() bool {
		for _, d := range rec.deliveries() {
			if d.Start.After(settle) {
				return false
			}
		}
		return true
	})
	waiting := e.count(t, `SELECT count(*) FROM queue_messages WHERE queue_name = 'toggled' AND claim_token IS NULL`)
	if waiting == 0 {
		t.Fatal("no message is waiting for the disabled consumer: the test proves nothing")
	}
	t.Logf("the disable read by a reload %s after it; %d of %d messages enqueued after it delivered (all within %s of the reload), %d waiting",
		read.Sub(disabled).Round(time.Millisecond), int(rec.n.Load())-1, len(ids), grace, waiting)

	e.enqueue(t, "other", "unaffected", bellhop.EnqueueOptions{})
	// Unaffected: delivered, with the poll an hour away. How fast is
	// TestPushNotPoll's to bound; a second here was a thin margin for a
	// delivery on a loaded machine under -race.
	waitFor(t, 10*time.Second, "delivery to the other, enabled consumer", func() bool { return other.n.Load() == 1 })

	if err := e.client.SetConsumerEnabled(ctx, "app", toggled.ID, true); err != nil {
		t.Fatal(err)
	}
	enabled := time.Now()
	// A backlog of about 75 delivered and acked: up to 189ms measured
	// beside a CPU hog, so a second was a thin margin under CI's load;
	// the poll is an hour away, so only the enable's reload can drain it.
	waitFor(t, 10*time.Second, "every waiting message delivered after the enable", func() bool {
		return e.count(t, `SELECT count(*) FROM queue_messages WHERE queue_name = 'toggled'`) == 0
	})
	t.Logf("backlog of %d drained %s after the enable", waiting, time.Since(enabled).Round(time.Millisecond))
	if got, want := int(rec.n.Load()), 1+len(ids); got != want {
		t.Errorf("%d deliveries in all, want %d", got, want)
	}
}
