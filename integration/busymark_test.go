package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
)

// TestBusyMarksLoseNoWakeUp is the stress test of the busy-mark protocol
// (migrations/0041_busy_marks.sql): producers and dispatchers at random
// rates, with the fallback poll at one hour, so only notifications and the
// protocol itself can get a message delivered. Some producers hold their
// transaction open after the INSERT, which is the window in which a
// producer has read a mark but not yet committed. Every message must be
// delivered within 1s of its commit, and the marks must actually have
// saved notifications.
func TestBusyMarksLoseNoWakeUp(t *testing.T) {
	e := newEnv(t)
	queues := []string{"q0", "q1", "q2"}
	for i, q := range queues {
		// Small in-flight limits make backlogs, hence marks.
		e.consumer(t, bellhop.ConsumerSpec{Queue: q, MaxInFlight: 1 + 2*i, VisibilityTimeout: 30 * time.Second})
	}

	var mu sync.Mutex
	delivered := map[uuid.UUID]time.Time{}
	handler := bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
		now := time.Now()
		mu.Lock()
		if _, ok := delivered[m.ID]; !ok {
			delivered[m.ID] = now
		}
		mu.Unlock()
		// Handlers of random speed keep the lanes alternating between
		// draining and idle.
		if d := rand.N(3 * time.Millisecond); d > time.Millisecond {
			time.Sleep(d)
		}
		return nil
	})
	mux := bellhop.NewMux()
	for _, q := range queues {
		mux.Handle("app", q, handler)
	}
	var dispatchers []*running
	for range 3 {
		dispatchers = append(dispatchers, startDispatcher(t, e.dsn, bellhop.DispatcherConfig{
			Resolver: mux, PollInterval: time.Hour, BusyLease: 300 * time.Millisecond,
		}, func(c *pgxpool.Config) { c.MaxConns = 6 }))
	}

	// Producers: bursts, pauses and slow commits, for a few seconds.
	const producers = 8
	run := 4 * time.Second
	var committed sync.Map // id -> commit time
	var total, notified int64
	var wg sync.WaitGroup
	start := time.Now()
	for p := range producers {
		wg.Go(func() {
			ctx := context.Background()
			for time.Since(start) < run {
				burst := 1 + rand.N(40)
				for range burst {
					q := queues[rand.N(len(queues))]
					tx, err := e.pool.Begin(ctx)
					if err != nil {
						t.Error(err)
						return
					}
					payload, _ := json.Marshal(map[string]int{"p": p})
					id, err := e.client.EnqueueTx(ctx, tx, "app", q, payload, bellhop.EnqueueOptions{})
					if err != nil {
						t.Error(err)
						tx.Rollback(ctx)
						return
					}
					if rand.N(10) == 0 {
						// Read a mark, then linger before committing.
						time.Sleep(rand.N(50 * time.Millisecond))
					}
					if err := tx.Commit(ctx); err != nil {
						t.Error(err)
						return
					}
					committed.Store(id, time.Now())
					mu.Lock()
					total++
					mu.Unlock()
				}
				time.Sleep(rand.N(150 * time.Millisecond))
			}
		})
	}
	wg.Wait()

	waitFor(t, 20*time.Second, "every message delivered", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(delivered) == int(total)
	})
	var late []string
	var waits []time.Duration
	committed.Range(func(k, v any) bool {
		mu.Lock()
		at, ok := delivered[k.(uuid.UUID)]
		mu.Unlock()
		if !ok {
			late = append(late, fmt.Sprintf("%s never delivered", k))
			return true
		}
		w := at.Sub(v.(time.Time))
		waits = append(waits, w)
		if w > time.Second {
			late = append(late, fmt.Sprintf("%s delivered %s after its commit", k, w))
		}
		return true
	})
	if len(late) > 0 {
		t.Fatalf("%d of %d messages late or lost, e.g. %v", len(late), total, late[:min(5, len(late))])
	}
	sort.Slice(waits, func(i, j int) bool { return waits[i] < waits[j] })
	for _, d := range dispatchers {
		notified += int64(d.ListenerStats().Notifications)
	}
	// Every dispatcher hears every notification, so divide by three.
	perDispatcher := notified / int64(len(dispatchers))
	t.Logf("%d messages; commit to first delivery p50 %s, p99 %s, max %s; %d queue notifications per dispatcher",
		total, waits[len(waits)/2], waits[len(waits)*99/100], waits[len(waits)-1], perDispatcher)
	if perDispatcher >= total {
		t.Errorf("%d notifications for %d messages: busy marks saved none", perDispatcher, total)
	}
}

// TestBusyMarkOfDeadDispatcher: a dispatcher that dies while its busy mark
// is live leaves producers silent until the lease ends; another
// dispatcher that saw the mark looks again when it ends, so the messages
// wait at most the lease, not the fallback poll (here one hour).
func TestBusyMarkOfDeadDispatcher(t *testing.T) {
	e := newEnv(t)
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders"})
	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	claims := &claimCounter{}
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour},
		func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = claims })
	// Let the start-up passes (a reclaim pass, then one per lane after
	// LISTEN) finish: quiet for 300ms, so the next pass is the one the
	// mark's wake-up causes.
	claims.waitQuiet(t, 10*time.Second, 300*time.Millisecond, "start-up passes done")
	passes := claims.ended.Load()

	// The dead dispatcher's mark, exactly as busy_mark.sql writes a fresh
	// one: the row, and a wake-up so that live dispatchers learn of it.
	const lease = 1500 * time.Millisecond
	var leaseEnd time.Time
	err := e.pool.QueryRow(context.Background(), `
		WITH m AS (
			INSERT INTO queue_busy (app_id, queue_name, owner, lease_until)
			SELECT id, 'orders', gen_random_uuid(), clock_timestamp() + $1 * interval '1 millisecond' FROM apps WHERE name = 'app'
			RETURNING app_id, lease_until)
		SELECT lease_until, pg_notify('bellhop', 'q:' || app_id || ':orders') IS NULL FROM m`,
		lease.Milliseconds()).Scan(&leaseEnd, new(bool))
	if err != nil {
		t.Fatal(err)
	}
	// The live dispatcher looks once, sees the mark, and watches it.
	waitFor(t, 5*time.Second, "the mark's wake-up pass", func() bool { return claims.ended.Load() > passes })
	// Producers now see a live mark and do not notify.
	var ids []uuid.UUID
	for i := range 5 {
		ids = append(ids, e.enqueue(t, "orders", map[string]int{"i": i}, bellhop.EnqueueOptions{}))
	}
	holdsFor(t, time.Until(leaseEnd)-100*time.Millisecond, "nothing delivered while the dead mark is live", func() bool {
		return len(rec.deliveries()) == 0
	})
	waitFor(t, time.Until(leaseEnd)+time.Second, "delivered once the dead mark's lease ended", func() bool {
		return len(rec.deliveries()) == len(ids)
	})
	if late := time.Since(leaseEnd); late > time.Second {
		t.Errorf("delivered %s after the lease ended", late)
	}
}
