package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
)

// TestThreeDispatchers: three dispatchers, each with its own small pool,
// share 10,000 messages over 20 queues. With no fault, every message is
// handled exactly once, and never by two handlers at the same moment.
func TestThreeDispatchers(t *testing.T) {
	const (
		dispatchers = 3
		queues      = 20
		messages    = 10_000
		batch       = 500
	)
	e := newEnv(t)
	for q := range queues {
		e.consumer(t, bellhop.ConsumerSpec{Queue: fmt.Sprintf("q%02d", q)})
	}

	var (
		inHandler [messages]atomic.Int32 // handlers running on message i now
		handled   [messages]atomic.Int32 // handler calls for message i, ever
		perD      [dispatchers]atomic.Int64
		total     atomic.Int64
		overlaps  atomic.Int64
	)
	handler := func(d int) bellhop.Handler {
		return bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
			var p struct{ I int }
			if err := json.Unmarshal(m.Payload, &p); err != nil || p.I < 0 || p.I >= messages {
				t.Errorf("bad payload %s: %v", m.Payload, err)
				return bellhop.Permanent(fmt.Errorf("bad payload"))
			}
			if inHandler[p.I].Add(1) != 1 {
				overlaps.Add(1)
				t.Errorf("message %d (%s) handled twice at the same moment", p.I, m.ID)
			}
			handled[p.I].Add(1)
			perD[d].Add(1)
			inHandler[p.I].Add(-1)
			total.Add(1)
			return nil
		})
	}
	var running []*running
	for d := range dispatchers {
		mux := bellhop.NewMux()
		for q := range queues {
			mux.Handle("app", fmt.Sprintf("q%02d", q), handler(d))
		}
		running = append(running, startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour},
			func(pc *pgxpool.Config) { pc.MaxConns = 6 }))
	}

	start := time.Now()
	ctx := context.Background()
	var producers sync.WaitGroup
	for b := 0; b < messages; b += batch {
		msgs := make([]bellhop.NewMessage, 0, batch)
		for i := b; i < b+batch; i++ {
			msgs = append(msgs, bellhop.NewMessage{
				Queue:   fmt.Sprintf("q%02d", i%queues),
				Payload: fmt.Appendf(nil, `{"i":%d}`, i),
			})
		}
		producers.Go(func() {
			if _, err := e.client.EnqueueMany(ctx, "app", msgs); err != nil {
				t.Error(err)
			}
		})
	}
	producers.Wait()
	waitFor(t, 60*time.Second, "all messages handled and acked", func() bool {
		return total.Load() >= messages && e.count(t, `SELECT count(*) FROM queue_messages`) == 0
	})
	elapsed := time.Since(start)
	// Stop all three (concurrently: each waits for its handlers), so no
	// delivery can still be on its way when the counts are read.
	var stops sync.WaitGroup
	for _, r := range running {
		stops.Go(r.stop)
	}
	stops.Wait()

	t.Logf("%d messages in %s (%.0f/s); per dispatcher: %d, %d, %d", messages, elapsed.Round(time.Millisecond),
		messages/elapsed.Seconds(), perD[0].Load(), perD[1].Load(), perD[2].Load())
	if n := overlaps.Load(); n > 0 {
		t.Errorf("%d concurrent double deliveries", n)
	}
	twice, never := 0, 0
	for i := range handled {
		switch handled[i].Load() {
		case 0:
			never++
		case 1:
		default:
			twice++
		}
	}
	if twice > 0 || never > 0 {
		t.Errorf("%d messages handled more than once, %d never; want each exactly once", twice, never)
	}
	for d := range dispatchers {
		if perD[d].Load() == 0 {
			t.Errorf("dispatcher %d handled nothing: the test did not share the work", d)
		}
	}
	if n := e.count(t, `SELECT count(*) FROM dead_letters`); n != 0 {
		t.Errorf("%d dead letters, want none", n)
	}
}
