package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"sort"
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
	queries "github.com/bellhopq/bellhop/sql"
)

// TestBusyMarksLoseNoWakeUp is the stress test of the busy-mark protocol
// (migrations/0041_busy_marks.sql, 0042_busy_locks.sql): producers and dispatchers at random
// rates, with the fallback poll at one hour, so only notifications and the
// protocol itself can get a message delivered. Some producers hold their
// transaction open after the INSERT, which is the window in which a
// producer has read a mark but not yet committed. Every message must be
// claimed within a BusyLease and a second of its commit, or of the moment
// a slot freed for it if that is later, and the marks must actually have
// saved notifications. The bound used to be a second from commit to
// handler start, which counts the wait behind a burst of up to 40 messages
// at MaxInFlight 1 (525ms measured beside a CPU hog): little was left of
// it for the protocol, whose watch passes come a BusyLease apart.
func TestBusyMarksLoseNoWakeUp(t *testing.T) {
	e := newEnv(t)
	// Producers must outpace the dispatchers for queues to turn busy. On a
	// server with fsync on (a DATABASE_URL of one's own) a durable commit
	// takes long enough that they never do, and the test measured
	// nothing; delivery does not depend on the producers' durability.
	cfg := e.pool.Config()
	cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "off"
	fast, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fast.Close)
	e.pool, e.client = fast, bellhop.NewClient(fast)
	queues := []string{"q0", "q1", "q2"}
	// A message's lease deadline, at its handler's start, is the claim's
	// send time plus vt less a fifth of it (TestLeaseDeadline): it tells
	// when the claim that took the message was sent, which a wake-up
	// starts, and not how late the loaded machine then ran the handler.
	const vt = 20 * time.Second
	for i, q := range queues {
		// Small in-flight limits make backlogs, hence marks.
		e.consumer(t, bellhop.ConsumerSpec{Queue: q, MaxInFlight: 1 + 2*i, VisibilityTimeout: vt})
	}

	type claimed struct {
		queue      string
		sent, seen time.Time // the claim's send time; the handler's start
	}
	var mu sync.Mutex
	delivered := map[uuid.UUID]claimed{}
	ends := map[string][]time.Time{} // by queue, when each handler returned
	handler := bellhop.HandlerFunc(func(ctx context.Context, m *bellhop.Message) error {
		now := time.Now()
		mu.Lock()
		if _, ok := delivered[m.ID]; !ok {
			delivered[m.ID] = claimed{queue: m.Queue, sent: m.LeaseDeadline().Add(-(vt - vt/5)), seen: now}
		}
		mu.Unlock()
		// Handlers of random speed keep the lanes alternating between
		// draining and idle.
		if d := rand.N(3 * time.Millisecond); d > time.Millisecond {
			time.Sleep(d)
		}
		mu.Lock()
		ends[m.Queue] = append(ends[m.Queue], time.Now())
		mu.Unlock()
		return nil
	})
	mux := bellhop.NewMux()
	for _, q := range queues {
		mux.Handle("app", q, handler)
	}
	const busyLease = 300 * time.Millisecond
	var dispatchers []*running
	for range 3 {
		dispatchers = append(dispatchers, startDispatcher(t, e.dsn, bellhop.DispatcherConfig{
			Resolver: mux, PollInterval: time.Hour, BusyLease: busyLease,
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
	// A message behind others of its queue waits for a slot however the
	// wake-ups go, so it is judged from the later of its commit and the
	// last handler end on its queue before its claim was sent: the time
	// it waited with nothing of its queue left to finish. A lost wake-up
	// leaves it there, its queue idle, until a later notification or the
	// poll an hour away, and the wait counts in full; a slot that frees
	// while it waits wakes a lane, which claims the oldest first. A
	// message that only another dispatcher's watch pass finds waits up to
	// a BusyLease, and the longest waits measured beside a CPU hog were
	// just under one (264 – 278ms); the second more is for scheduling.
	limit := busyLease + time.Second
	mu.Lock()
	for _, at := range ends {
		sort.Slice(at, func(i, j int) bool { return at[i].Before(at[j]) })
	}
	mu.Unlock()
	var late []string
	var waits, slotWaits []time.Duration
	committed.Range(func(k, v any) bool {
		mu.Lock()
		defer mu.Unlock()
		c, ok := delivered[k.(uuid.UUID)]
		if !ok {
			late = append(late, fmt.Sprintf("%s never delivered", k))
			return true
		}
		commit := v.(time.Time)
		waits = append(waits, c.seen.Sub(commit))
		from := commit
		at := ends[c.queue]
		if i := sort.Search(len(at), func(i int) bool { return !at[i].Before(c.sent) }); i > 0 && at[i-1].After(from) {
			from = at[i-1]
		}
		w := c.sent.Sub(from)
		slotWaits = append(slotWaits, w)
		if w > limit {
			late = append(late, fmt.Sprintf("%s claimed %s after its commit or a slot's freeing (%s after its commit)",
				k, w.Round(time.Millisecond), c.sent.Sub(commit).Round(time.Millisecond)))
		}
		return true
	})
	if len(late) > 0 {
		t.Fatalf("%d of %d messages late or lost, e.g. %v", len(late), total, late[:min(5, len(late))])
	}
	for _, ws := range [][]time.Duration{waits, slotWaits} {
		sort.Slice(ws, func(i, j int) bool { return ws[i] < ws[j] })
	}
	for _, d := range dispatchers {
		notified += int64(d.ListenerStats().Notifications)
	}
	// Every dispatcher hears every notification, so divide by three.
	perDispatcher := notified / int64(len(dispatchers))
	t.Logf("%d messages; commit to first delivery p50 %s, p99 %s, max %s; claim after its commit or a slot's freeing p50 %s, p99 %s, max %s; %d queue notifications per dispatcher",
		total, waits[len(waits)/2], waits[len(waits)*99/100], waits[len(waits)-1],
		slotWaits[len(slotWaits)/2], slotWaits[len(slotWaits)*99/100], slotWaits[len(slotWaits)-1], perDispatcher)
	if perDispatcher >= total {
		t.Errorf("%d notifications for %d messages: busy marks saved none", perDispatcher, total)
	}
}

// TestBusyMarkOfDeadDispatcher: a dispatcher that dies while its busy mark
// is live takes the mark producers see with it (its busy key ends with its
// session), so producers announce again at once, although its row, the
// mark other dispatchers see, is live for a while yet.
func TestBusyMarkOfDeadDispatcher(t *testing.T) {
	e := newEnv(t)
	rec, _ := startOrders(t, e, bellhop.DispatcherConfig{})

	// The dead dispatcher's row, with a long lease; its session, and so
	// its busy key, is gone.
	leaseEnd := deadMark(t, e, time.Minute)
	var ids []uuid.UUID
	for i := range 5 {
		ids = append(ids, e.enqueue(t, "orders", map[string]int{"i": i}, bellhop.EnqueueOptions{}))
	}
	waitFor(t, 2*time.Second, "delivered while the dead row is live", func() bool {
		return len(rec.deliveries()) == len(ids)
	})
	if time.Now().After(leaseEnd) {
		t.Fatal("the row's lease ended before the test could tell")
	}
}

// TestBusyMarkOfHungDispatcher: a dispatcher that hangs keeps its busy key,
// and producers stay silent, until the server's idle_session_timeout ends
// its session; its row's lease ends first. Another dispatcher that saw the
// mark keeps watching while the key is held, looking again every BusyLease,
// so the messages wait at most that long, not for the fallback poll (here
// one hour). Watching the row alone would stop when its lease ends, and
// strand messages sent after that.
func TestBusyMarkOfHungDispatcher(t *testing.T) {
	e := newEnv(t)
	const busyLease = 500 * time.Millisecond
	rec, claims := startOrders(t, e, bellhop.DispatcherConfig{BusyLease: busyLease})
	passes := claims.ended.Load()

	// The hung dispatcher: its busy key, held by a session that the server
	// ends after 4s of silence, as internal/busylock holds it.
	const idle = 4 * time.Second
	hung, _ := holdOrdersKey(t, e, idle)
	sessionEnd := time.Now().Add(idle)
	// Its row, whose lease ends long before the session does.
	leaseEnd := deadMark(t, e, 200*time.Millisecond)
	waitFor(t, 5*time.Second, "the mark's wake-up pass", func() bool { return claims.ended.Load() > passes })
	holdsFor(t, time.Until(leaseEnd.Add(busyLease)), "quiet until the row's lease has ended", func() bool {
		return len(rec.deliveries()) == 0
	})

	var ids []uuid.UUID
	for i := range 5 {
		ids = append(ids, e.enqueue(t, "orders", map[string]int{"i": i}, bellhop.EnqueueOptions{}))
	}
	sent := time.Now()
	waitFor(t, time.Until(sessionEnd), "delivered while the hung session holds the key", func() bool {
		return len(rec.deliveries()) == len(ids)
	})
	if took := time.Since(sent); took > busyLease+time.Second {
		t.Errorf("delivered %s after sending; want within a BusyLease (%s) and a margin", took, busyLease)
	}
	// Not a ping: it would keep the session alive.
	waitFor(t, time.Until(sessionEnd)+3*time.Second, "the server ends the hung session and its key", func() bool {
		return e.count(t, busyKeyHeld, "orders") == 0
	})
	if err := hung.Ping(context.Background()); err == nil {
		t.Error("the hung session still answers after its idle_session_timeout")
	}
}

// TestBusyKeyWithoutRow: a dispatcher that takes a queue's busy key and
// dies, or hangs, before it writes its queue_busy row leaves producers
// silent with no row to watch. Taking the key tells the other dispatchers
// itself (sql/busy_hold.sql), so a live one watches the key and delivers
// within a BusyLease, with the fallback poll an hour away
// (model/README.md, finding A). So does one that marks no queue itself
// (DisableBusyMarks): found by review, it never looked again at the
// marks it saw, and the messages waited for its fallback poll.
func TestBusyKeyWithoutRow(t *testing.T) {
	for _, disable := range []bool{false, true} {
		t.Run(fmt.Sprintf("DisableBusyMarks=%t", disable), func(t *testing.T) { busyKeyWithoutRow(t, disable) })
	}
}

func busyKeyWithoutRow(t *testing.T, disableMarks bool) {
	e := newEnv(t)
	const busyLease = 500 * time.Millisecond
	rec, claims := startOrders(t, e, bellhop.DispatcherConfig{BusyLease: busyLease, DisableBusyMarks: disableMarks})
	passes := claims.ended.Load()

	ctx := context.Background()
	other, _ := holdOrdersKey(t, e, time.Hour)
	if n := e.count(t, "SELECT count(*) FROM queue_busy"); n != 0 {
		t.Fatalf("%d queue_busy rows; the test needs none", n)
	}
	waitFor(t, 5*time.Second, "the key's wake-up pass", func() bool { return claims.ended.Load() > passes })

	var ids []uuid.UUID
	for i := range 5 {
		ids = append(ids, e.enqueue(t, "orders", map[string]int{"i": i}, bellhop.EnqueueOptions{}))
	}
	sent := time.Now()
	waitFor(t, 10*time.Second, "delivered while another session holds the key", func() bool {
		return len(rec.deliveries()) == len(ids)
	})
	if took := time.Since(sent); took > busyLease+time.Second {
		t.Errorf("delivered %s after sending; want within a BusyLease (%s) and a margin", took, busyLease)
	}
	// The holder dies: producers announce again.
	var pid uint32
	if err := other.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	if _, err := e.pool.Exec(ctx, "SELECT pg_terminate_backend($1)", pid); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the key is free", func() bool {
		return e.count(t, busyKeyHeld, "orders") == 0
	})
	ids = append(ids, e.enqueue(t, "orders", map[string]int{"i": 5}, bellhop.EnqueueOptions{}))
	waitFor(t, 5*time.Second, "delivered after the holder died", func() bool {
		return len(rec.deliveries()) == len(ids)
	})
}

// holdOrdersKey takes the busy key of app "app"'s queue "orders" on a new
// session, as internal/busylock does, with idle as its
// idle_session_timeout (0: none), and checks that the hold was announced.
// It returns the session, closed when the test ends, and the app's id.
func holdOrdersKey(t *testing.T, e *env, idle time.Duration) (*pgx.Conn, uuid.UUID) {
	t.Helper()
	ctx := context.Background()
	var appID uuid.UUID
	if err := e.pool.QueryRow(ctx, "SELECT id FROM apps WHERE name = 'app'").Scan(&appID); err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, e.dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	var held bool
	var notified int64
	err = conn.QueryRow(ctx, queries.BusyHold, pgx.NamedArgs{
		"app_id": appID, "queue_name": "orders", "owner": uuid.New(), "idle_ms": idle.Milliseconds(),
	}).Scan(new(bool), &held, &notified)
	if err != nil || !held || notified != 1 {
		t.Fatalf("hold the busy key: held %v, notified %d, %v", held, notified, err)
	}
	return conn, appID
}

// startOrders registers a consumer of queue "orders", starts a dispatcher
// (cfg with a recorder as the handler and the fallback poll an hour away)
// and waits until its start-up passes are done, so that the next pass is
// one the test causes.
func startOrders(t *testing.T, e *env, cfg bellhop.DispatcherConfig) (*recorder, *claimCounter) {
	t.Helper()
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders"})
	rec := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	claims := &claimCounter{}
	cfg.Resolver, cfg.PollInterval = mux, time.Hour
	startDispatcher(t, e.dsn, cfg, func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = claims })
	claims.waitQuiet(t, 10*time.Second, 300*time.Millisecond, "start-up passes done")
	return rec, claims
}

// deadMark writes a dispatcher's busy-mark row for queue "orders" that no
// live dispatcher owns, with the given lease, exactly as busy_mark.sql
// writes a fresh one: the row, and a wake-up so that live dispatchers
// learn of it. It returns the lease's end.
func deadMark(t *testing.T, e *env, lease time.Duration) time.Time {
	t.Helper()
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
	return leaseEnd
}

// TestWakeScanSeesBusyKeys: after a listener reconnect, the wake scan
// (sql/wake_scan.sql) must list a queue whose busy key another session
// holds, even with no unclaimed message and no live row: its producers are
// silent, and the lane has to watch the key.
func TestWakeScanSeesBusyKeys(t *testing.T) {
	e := newEnv(t)
	orders := e.consumer(t, bellhop.ConsumerSpec{Queue: "orders"})
	e.consumer(t, bellhop.ConsumerSpec{Queue: "other"})
	ctx := context.Background()
	var appID uuid.UUID
	if err := e.pool.QueryRow(ctx, "SELECT id FROM apps WHERE name = 'app'").Scan(&appID); err != nil {
		t.Fatal(err)
	}
	scan := func() []uuid.UUID {
		t.Helper()
		var queueLanes, invokeLanes []uuid.UUID
		err := e.pool.QueryRow(ctx, queries.WakeScan, pgx.NamedArgs{"owner": uuid.New(), "heartbeat": ""}).Scan(&queueLanes, &invokeLanes, new(bool))
		if err != nil {
			t.Fatal(err)
		}
		return queueLanes
	}
	if got := scan(); len(got) != 0 {
		t.Fatalf("wake scan of idle queues = %v, want none", got)
	}
	holder, appID := holdOrdersKey(t, e, 0)
	if got := scan(); len(got) != 1 || got[0] != orders.ID {
		t.Errorf("wake scan while the key of %q is held = %v, want [%s]", "orders", got, orders.ID)
	}
	var released bool
	err := holder.QueryRow(ctx, queries.BusyRelease, pgx.NamedArgs{"app_id": appID, "queue_name": "orders", "idle_ms": 0}).
		Scan(new(bool), &released)
	if err != nil || !released {
		t.Fatalf("release the busy key: %v, %v", released, err)
	}
	if got := scan(); len(got) != 0 {
		t.Errorf("wake scan after the release = %v, want none", got)
	}
}

// TestBusyKeysOfCollidingQueues: two queues of one app whose 32-bit
// hashtext(app_id || ':' || queue) are equal, which shared their busy key
// before migration 0052 (about one pair in a hundred thousand queues, and
// easy to make on purpose). While a dispatcher drains A and holds A's
// busy key, a message enqueued to B is announced and delivered at once;
// with the shared key, B's producer skipped its notification and nothing
// woke B's lane (the fallback poll is an hour away).
func TestBusyKeysOfCollidingQueues(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	var a, b string
	if err := e.pool.QueryRow(ctx, `
		WITH app AS (SELECT id::text AS id FROM apps WHERE name = 'app'),
		     h AS (SELECT 'q' || i AS q, hashtext(app.id || ':q' || i) AS k FROM app, generate_series(1, 400000) AS i)
		SELECT min(q), max(q) FROM h GROUP BY k HAVING count(*) = 2 LIMIT 1`).Scan(&a, &b); err != nil {
		t.Fatalf("no pair of colliding queue names among 400,000: %v", err)
	}
	t.Logf("queues %s and %s share their 32-bit hash", a, b)
	e.consumer(t, bellhop.ConsumerSpec{Queue: a, MaxInFlight: 1})
	e.consumer(t, bellhop.ConsumerSpec{Queue: b})
	slow := &recorder{result: func(context.Context, *bellhop.Message) error {
		time.Sleep(20 * time.Millisecond) // A's work: long enough to keep it busy
		return nil
	}}
	recB := &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", a, slow)
	mux.Handle("app", b, recB)
	claims := &claimCounter{}
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour},
		func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = claims })
	claims.waitQuiet(t, 10*time.Second, 300*time.Millisecond, "start-up passes done")

	for i := range 60 {
		e.enqueue(t, a, map[string]int{"i": i}, bellhop.EnqueueOptions{})
	}
	waitFor(t, 10*time.Second, "A's busy key held", func() bool { return e.count(t, busyKeyHeld, a) == 1 })
	e.enqueue(t, b, map[string]string{"to": "B"}, bellhop.EnqueueOptions{})
	waitFor(t, 10*time.Second, "B's message delivered while A is busy", func() bool { return len(recB.deliveries()) == 1 })
	if n := len(slow.deliveries()); n == 60 {
		t.Errorf("A had drained before B's delivery: the test did not make them overlap")
	}
}

// fullHolder starts dispatcher A on queue "orders" (MaxInFlight 1, the
// given busy lease) and leaves it busy and holding the queue's busy key,
// its one slot taken by a handler that blocks until the test ends, so
// that it makes no claim pass. It returns the mux serving "orders" with
// the same handler, for another dispatcher, and the recorder of the
// deliveries that finished (the blocked one never does).
func fullHolder(t *testing.T, e *env, lease time.Duration) (*bellhop.Mux, *recorder) {
	t.Helper()
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders", MaxInFlight: 1, VisibilityTimeout: time.Minute})
	release := make(chan struct{})
	var blocked atomic.Bool
	rec := &recorder{result: func(ctx context.Context, m *bellhop.Message) error {
		if string(m.Payload) == `"block"` {
			blocked.Store(true)
			select {
			case <-release:
			case <-ctx.Done():
			}
		}
		return nil
	}}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour, BusyLease: lease}, nil)
	t.Cleanup(func() { close(release) }) // before the dispatcher stops
	// The first pass fills the slot, which makes the lane busy; the next
	// ones, as the slot frees, take the key, until "block" holds the slot.
	msgs := []bellhop.NewMessage{{Queue: "orders", Payload: []byte(`1`)}, {Queue: "orders", Payload: []byte(`2`)},
		{Queue: "orders", Payload: []byte(`3`)}, {Queue: "orders", Payload: []byte(`"block"`)}}
	if _, err := e.client.EnqueueMany(context.Background(), "app", msgs); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "A's slot taken by the blocking handler", blocked.Load)
	waitFor(t, 10*time.Second, "A holds the busy key", func() bool {
		return e.count(t, busyKeyHeld+` AND mode = 'ExclusiveLock'`, "orders") == 1
	})
	waitFor(t, 10*time.Second, "A's other deliveries finished", func() bool { return len(rec.deliveries()) == 3 })
	return mux, rec
}

// deliveredBy waits until message id's delivery has finished, and returns
// when it started.
func deliveredBy(t *testing.T, rec *recorder, id uuid.UUID, timeout time.Duration) time.Time {
	t.Helper()
	var at time.Time
	waitFor(t, timeout, "message "+id.String()+" delivered", func() bool {
		for _, d := range rec.deliveries() {
			if d.ID == id {
				at = d.Start
				return true
			}
		}
		return false
	})
	return at
}

// TestBusyKeyRefusedKeepsLockSession: a dispatcher B whose lane turns
// busy while another dispatcher A holds the queue's busy key is refused
// the key, and its lock session, which then holds no key and sends no
// keep-alives, must not be timed out. Its Hold used to arm the session's
// idle_session_timeout all the same: the server ended the session after
// BusyLease, B's next Hold failed, B counted the key as lost, and settled,
// a lock check and a claim every 20 ms or less, for as long as A held the
// key, instead of watching it once per lease.
func TestBusyKeyRefusedKeepsLockSession(t *testing.T) {
	e := newEnv(t)
	const lease = 500 * time.Millisecond
	mux, rec := fullHolder(t, e, lease)
	lockSessions := func() int {
		return e.count(t, `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = 'bellhop-busy-locks' AND datname = current_database()`)
	}
	if n := lockSessions(); n != 1 {
		t.Fatalf("%d busy-lock sessions with only A running; want 1", n)
	}
	claims := &claimCounter{}
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour, BusyLease: lease},
		func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = claims })

	// B's watch pass claims it (producers are silent), which fills B's
	// slot: B's lane turns busy, and its next pass asks for the key.
	first := e.enqueue(t, "orders", "first", bellhop.EnqueueOptions{})
	deliveredBy(t, rec, first, 10*lease)
	waitFor(t, 10*lease, "B's lock session opened by its Hold", func() bool { return lockSessions() == 2 })
	holdsFor(t, 4*lease, "B's lock session alive", func() bool { return lockSessions() == 2 })

	// B turns busy again, and is refused again, not failed.
	second := e.enqueue(t, "orders", "second", bellhop.EnqueueOptions{})
	deliveredBy(t, rec, second, 10*lease)
	before := claims.queue.Load()
	window := 4 * lease
	holdsFor(t, window, "B's lock session alive", func() bool { return lockSessions() == 2 })
	passes := claims.queue.Load() - before
	t.Logf("B made %d claim passes in %s while A held the key (BusyLease %s)", passes, window, lease)
	// Watching: about one pass per lease. Settling: one every 20 ms.
	if limit := int64(3 * window / lease); passes > limit {
		t.Errorf("B made %d claim passes in %s while A held the key; want about one per lease (%s), at most %d",
			passes, window, lease, limit)
	}
}

// claimFailures passes a dispatcher's log on to the test's, and tells of
// its first "claim failed" line: when it was written, and when the lane
// will try again (its retry_in).
type claimFailures struct {
	next io.Writer
	once sync.Once
	seen chan claimFailure // capacity 1
}

type claimFailure struct {
	at      time.Time
	retryIn time.Duration
}

func (c *claimFailures) Write(p []byte) (int, error) {
	var line struct {
		Message string `json:"message"`
		RetryIn string `json:"retry_in"` // as time.Duration prints it
	}
	if json.Unmarshal(p, &line) == nil && strings.HasPrefix(line.Message, "claim failed") {
		at := time.Now()
		retryIn, err := time.ParseDuration(line.RetryIn)
		if err != nil {
			retryIn = -1 // the test fails on it
		}
		c.once.Do(func() {
			c.seen <- claimFailure{at: at, retryIn: retryIn}
		})
	}
	return c.next.Write(p)
}

// TestBusyLaneClaimFailureReleasesKey: a busy lane whose claim pass fails
// (here the server refuses one claim statement) gives up the busy key before it
// backs off, so that producers notify again, and a message committed after
// the failure is claimed when its notification arrives, not at the lane's
// retry, 0.5 – 1s later. It used to keep the key through the backoff:
// producers stayed silent, nothing woke the lane, and every such message
// waited for the retry (p50 1.1 – 1.8s measured, against 1.25ms with marks
// disabled), where the protocol promises a busy lane's next poll within
// BusyWindow/4.
func TestBusyLaneClaimFailureReleasesKey(t *testing.T) {
	e := newEnv(t)
	// A message's lease deadline, at its handler's start, is the claim's
	// send time (claim.Message.LeasedAt) plus vt less a fifth of it
	// (TestLeaseDeadline): it tells when the claim that took the message
	// was sent, which a notification wakes, and not how late the loaded
	// machine then ran the handler.
	const vt = 20 * time.Second
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders", MaxInFlight: 10, VisibilityTimeout: vt})
	var claimedMu sync.Mutex
	claimSent := map[uuid.UUID]time.Time{}
	rec := &recorder{result: func(_ context.Context, m *bellhop.Message) error {
		claimedMu.Lock()
		claimSent[m.ID] = m.LeaseDeadline().Add(-(vt - vt/5))
		claimedMu.Unlock()
		return nil
	}}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	failures := &claimFailures{next: zerolog.NewTestWriter(t), seen: make(chan claimFailure, 1)}
	// A window long enough that the lane is still busy, polling, when the
	// connections are killed, whatever the producer's pace on a loaded
	// machine.
	startLogged(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour, BusyWindow: 100 * time.Millisecond,
		Logger: zerolog.New(failures).With().Timestamp().Logger()},
		func(pc *pgxpool.Config) { pc.MaxConns, pc.MinConns = 4, 4 })

	// committed holds when each Enqueue began, which its commit cannot
	// precede. A time taken after Enqueue returned could fall after the
	// failure for a message committed before it, while producers were
	// silent: only the retry claims that one, and it would count as late.
	// returned holds when it returned, which its commit cannot follow.
	var committedMu sync.Mutex
	committed, returned := map[uuid.UUID]time.Time{}, map[uuid.UUID]time.Time{}
	enqueue := func(payload any) error {
		began := time.Now()
		id, err := e.tryEnqueue("orders", payload, bellhop.EnqueueOptions{})
		if err != nil {
			return err
		}
		committedMu.Lock()
		committed[id], returned[id] = began, time.Now()
		committedMu.Unlock()
		return nil
	}
	var stop atomic.Bool
	streamed := make(chan struct{})
	go func() {
		defer close(streamed)
		for i := 0; !stop.Load(); i++ {
			// t.Fatal may run only on the test's goroutine; t.Errorf fails
			// the test with the enqueue's own error.
			if err := enqueue(i); err != nil {
				t.Errorf("the stream's enqueue %d: %v", i, err)
				return
			}
			time.Sleep(2 * time.Millisecond) // a stream's pace, not synchronisation
		}
	}()
	defer func() { stop.Store(true); <-streamed }()
	waitFor(t, 10*time.Second, "the busy key held", func() bool {
		return e.count(t, busyKeyHeld+` AND mode = 'ExclusiveLock'`, "orders") == 1
	})
	// The next claim statement fails, once (a sequence is not rolled back
	// with it). Killing the pool's connections instead failed the claims
	// after the first one too, on the other dead connections: those
	// messages waited for the retry whatever producers did (CI, twice).
	for _, sql := range []string{
		`CREATE SEQUENCE claim_refusals`,
		`CREATE FUNCTION refuse_a_claim() RETURNS trigger LANGUAGE plpgsql AS $$
		 BEGIN
		   IF current_query() LIKE '%claim_token = gen_random_uuid()%' AND nextval('claim_refusals') = 1 THEN
		     RAISE EXCEPTION 'claim refused by the test';
		   END IF;
		   RETURN NULL;
		 END $$`,
		`CREATE TRIGGER refuse_a_claim BEFORE UPDATE ON queue_messages
		 FOR EACH STATEMENT EXECUTE FUNCTION refuse_a_claim()`,
	} {
		if _, err := e.pool.Exec(context.Background(), sql); err != nil {
			t.Fatal(err)
		}
	}
	var failed claimFailure
	select {
	case failed = <-failures.seen:
	case <-time.After(10 * time.Second):
		t.Fatal("no claim failed within 10s of the trigger that refuses one")
	}
	// Messages committed from now on: each must be delivered before the
	// lane's retry would have claimed it.
	for i := range 3 {
		if err := enqueue(fmt.Sprintf("probe %d", i)); err != nil {
			t.Fatalf("probe %d: %v", i, err)
		}
	}
	stop.Store(true)
	<-streamed
	retryAt := failed.at.Add(failed.retryIn)
	committedMu.Lock()
	defer committedMu.Unlock()
	waitFor(t, 10*time.Second+failed.retryIn, "every message delivered", func() bool {
		return len(rec.deliveries()) >= len(committed)
	})
	// Judged by when the claim that took each message was sent, not by
	// when its handler started: on a loaded machine (CI), the settle check,
	// claim and hand-off after the notification took longer than a retry
	// jittered down to 538ms, and every message counted as late. Only
	// messages surely committed judgeBy before the retry (their Enqueue
	// returned by then) are judged: one committed later may be claimed at
	// the retry whatever producers do, and one committed just before it
	// leaves its notification and claim no time to come first, so it
	// would count as late with the key given up as it should be. A lane
	// that keeps the key claims every judged message only at the retry,
	// so any one judged shows the bug.
	const judgeBy = 100 * time.Millisecond
	late, after, judged := 0, 0, 0
	var worst time.Duration
	claimedMu.Lock()
	defer claimedMu.Unlock()
	for _, d := range rec.deliveries() {
		at, ok := committed[d.ID]
		if !ok || at.Before(failed.at) {
			continue
		}
		after++
		sent := claimSent[d.ID]
		worst = max(worst, sent.Sub(at))
		if !returned[d.ID].Before(retryAt.Add(-judgeBy)) {
			continue
		}
		judged++
		if !sent.Before(retryAt) {
			late++
		}
	}
	t.Logf("claim failed, retry in %s; %d messages committed after the failure (%d of them %s or more before the retry), the slowest claimed %s after its commit",
		failed.retryIn.Round(time.Millisecond), after, judged, judgeBy, worst.Round(time.Millisecond))
	if after < 3 {
		t.Fatalf("%d deliveries of messages committed after the failure; want at least the 3 probes", after)
	}
	if judged == 0 {
		t.Fatalf("inconclusive: no message committed after the failure was committed %s or more before the retry, %s later", judgeBy, failed.retryIn.Round(time.Millisecond))
	}
	if late > 0 {
		t.Errorf("%d of %d messages committed after the claim failed and %s or more before its retry were claimed only at or after the retry (%s later): producers were silent meanwhile",
			late, judged, judgeBy, failed.retryIn.Round(time.Millisecond))
	}
}

// TestFullHolderWatched: a busy lane whose slots are all taken keeps the
// busy key while it waits for one (docs/busy-marks.md, step 2), so its
// producers stay silent; another dispatcher serving the queue with slots
// to spare claims their messages at its watch passes, within a BusyLease
// of each commit, not only when the holder frees a slot (here never).
func TestFullHolderWatched(t *testing.T) {
	e := newEnv(t)
	const lease = 500 * time.Millisecond
	mux, rec := fullHolder(t, e, lease)
	claims := &claimCounter{}
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour, BusyLease: lease},
		func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = claims })
	for i := range 3 {
		// B's lane has settled after its last delivery (a busy period:
		// MaxInFlight 1) and only watches, between two watch passes.
		claims.waitQuiet(t, 10*time.Second, lease/5, "B's lane asleep")
		id := e.enqueue(t, "orders", i, bellhop.EnqueueOptions{})
		sent := time.Now()
		at := deliveredBy(t, rec, id, 10*time.Second)
		if n := e.count(t, busyKeyHeld+` AND mode = 'ExclusiveLock'`, "orders"); n != 1 {
			t.Fatalf("%d sessions hold the busy key; want A's", n)
		}
		// The test allows a second more, for scheduling.
		if took := at.Sub(sent); took > lease+time.Second {
			t.Errorf("message %d delivered %s after its commit while the full holder kept the key; want within a BusyLease (%s) and a margin",
				i, took.Round(time.Millisecond), lease)
		} else {
			t.Logf("message %d delivered %s after its commit", i, took.Round(time.Millisecond))
		}
	}
}

// lostKeyLane starts a dispatcher (BusyLease lease, fallback poll an hour
// away) whose lane of queue "orders" turns busy under a stream and takes
// the busy key. Then it kills the dispatcher's lock session, so that the
// key is lost, not released, while another session, queued for the key
// beforehand, takes it the moment the killed backend lets go, and
// announces it as busy_hold.sql does (a stand-in for another dispatcher).
// Last, it ends the stream, so that the lane settles. It returns the
// handler's recorder, the statement counter, how many messages the stream
// enqueued, the other session, which holds the key, and the dispatcher.
func lostKeyLane(t *testing.T, e *env, lease time.Duration) (*recorder, *busyLockChecks, int, *pgx.Conn, *running) {
	t.Helper()
	ctx := context.Background()
	// A window long enough that the lane still holds the key when the
	// test sees it held.
	rec, checks, d, stopStream := busyOrders(t, e, bellhop.DispatcherConfig{BusyLease: lease, BusyWindow: 100 * time.Millisecond})

	var appID uuid.UUID
	if err := e.pool.QueryRow(ctx, "SELECT id FROM apps WHERE name = 'app'").Scan(&appID); err != nil {
		t.Fatal(err)
	}
	other, err := pgx.Connect(ctx, e.dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { other.Close(context.Background()) })
	granted := make(chan error, 1)
	go func() {
		_, err := other.Exec(ctx, `SELECT pg_advisory_lock(hashtextextended($1::uuid::text || ':orders', 1650814062))`, appID)
		granted <- err
	}()
	waitFor(t, 5*time.Second, "the other session queued for the key", func() bool {
		return e.count(t, strings.Replace(busyKeyHeld, "AND granted", "AND NOT granted", 1), "orders") == 1
	})
	if _, err := e.pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE application_name = 'bellhop-busy-locks' AND datname = current_database()`); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-granted:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the other session did not get the key within 5s of the lock session's end")
	}
	// Taken again by the session that holds it: granted, and announced.
	var held bool
	var notified int64
	err = other.QueryRow(ctx, queries.BusyHold, pgx.NamedArgs{
		"app_id": appID, "queue_name": "orders", "owner": uuid.New(), "idle_ms": 0,
	}).Scan(new(bool), &held, &notified)
	if err != nil || !held || notified != 1 {
		t.Fatalf("announce the other session's key: held %v, notified %d, %v", held, notified, err)
	}
	return rec, checks, stopStream(), other, d
}

// busyOrders registers a consumer of "orders" (MaxInFlight 10), starts a
// dispatcher for it as cfg says (its Resolver and a fallback poll an hour
// away set here) whose statements checks counts, and streams messages to
// the queue until its lane holds the busy key. stopStream ends the
// stream, and returns how many messages it sent; the test's cleanup
// calls it too.
func busyOrders(t *testing.T, e *env, cfg bellhop.DispatcherConfig) (rec *recorder, checks *busyLockChecks, d *running, stopStream func() int) {
	t.Helper()
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders", MaxInFlight: 10})
	rec = &recorder{}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	checks = &busyLockChecks{}
	cfg.Resolver, cfg.PollInterval = mux, time.Hour
	d = startDispatcher(t, e.dsn, cfg, func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = checks })
	var stop atomic.Bool
	var sent atomic.Int64
	streamed := make(chan struct{})
	go func() {
		defer close(streamed)
		for i := 0; !stop.Load(); i++ {
			// Not e.enqueue: t.Fatal may run only on the test's
			// goroutine; t.Errorf fails the test with the enqueue's own
			// error.
			if _, err := e.tryEnqueue("orders", i, bellhop.EnqueueOptions{}); err != nil {
				t.Errorf("the stream's enqueue %d: %v", i, err)
				return
			}
			sent.Add(1)
			time.Sleep(2 * time.Millisecond) // a stream's pace, not synchronisation
		}
	}()
	stopStream = func() int {
		stop.Store(true)
		<-streamed
		return int(sent.Load())
	}
	t.Cleanup(func() { stopStream() })
	waitFor(t, 10*time.Second, "the busy key held", func() bool {
		return e.count(t, busyKeyHeld+` AND mode = 'ExclusiveLock'`, "orders") == 1
	})
	return rec, checks, d, stopStream
}

// TestLostBusyKeyWatchesNewHolder: a lane whose busy key was lost with
// its lock session settles by waiting until the key is free of every
// session (needFree), since the old backend may hold it a moment longer.
// Here another session takes the key once producers notify again (a
// stand-in for another dispatcher, announced as busy_hold.sql does) and
// keeps it. The lane cannot tell that session from its own old backend,
// and it used to check the lock and claim every 20 ms for as long as the
// other held the key (89 claim passes in 2 s with a 500 ms BusyLease).
// It now backs off to watching the key as another dispatcher's mark
// (docs/busy-marks.md, step 3): a pass per BusyLease. A message committed
// meanwhile, which producers do not announce, is claimed at a watch pass;
// one committed after the other session released the key, or died, is
// announced and delivered at once, and the lane's settle ends.
func TestLostBusyKeyWatchesNewHolder(t *testing.T) {
	for _, end := range []string{"released", "died"} {
		t.Run(end, func(t *testing.T) {
			e := newEnv(t)
			const lease = 500 * time.Millisecond
			rec, checks, n, other, _ := lostKeyLane(t, e, lease)
			from := checks.n.Load()
			// The lane finds the key lost when it gives it back, at the
			// end of its busy period, and settles; the first checks back
			// off from 2 ms to the watch.
			waitFor(t, 10*time.Second, "the settle's first checks", func() bool { return checks.n.Load() >= from+10 })

			// A message its producer does not announce: a watch pass
			// claims it.
			e.enqueue(t, "orders", "while held", bellhop.EnqueueOptions{})
			n++
			const window = 2 * time.Second
			claims := checks.claims.Load()
			// One pass per BusyLease, and a margin for the message's.
			limit := int64(window/lease) + 3
			holdsFor(t, window, fmt.Sprintf("at most %d claim passes in %s while another session holds the key", limit, window), func() bool {
				return checks.claims.Load()-claims <= limit
			})
			t.Logf("%d claim passes in %s while another session held the key (BusyLease %s)", checks.claims.Load()-claims, window, lease)
			if got := len(rec.deliveries()); got != n {
				t.Fatalf("%d of %d messages delivered while another session held the key: the watch passes missed the last", got, n)
			}

			switch end {
			case "released":
				if _, err := other.Exec(context.Background(), `SELECT pg_advisory_unlock_all()`); err != nil {
					t.Fatal(err)
				}
			case "died":
				if err := other.Close(context.Background()); err != nil {
					t.Fatal(err)
				}
			}
			waitFor(t, 5*time.Second, "the key free", func() bool { return e.count(t, busyKeyHeld, "orders") == 0 })
			sentAt := time.Now()
			e.enqueue(t, "orders", "after", bellhop.EnqueueOptions{})
			n++
			waitFor(t, 5*time.Second, "the message committed after the other session "+end, func() bool { return len(rec.deliveries()) == n })
			// Its notification wakes the lane; the watch would come up to
			// a BusyLease later, and the fallback poll an hour later. The
			// time also holds the enqueue's round trip and the hand-off
			// to the handler, so the test allows a second more, for
			// scheduling, as TestFullHolderWatched does: a bound of a
			// BusyLease alone left a loaded machine little margin.
			took := time.Since(sentAt)
			t.Logf("the message committed after the other session %s delivered in %s", end, took.Round(time.Millisecond))
			if took > lease+time.Second {
				t.Errorf("delivered %s after it was sent; want within a BusyLease (%s) and a margin, woken by its notification", took, lease)
			}
			// The settle ended: no more checks, except the one of the pass
			// that claimed the message, which runs after the claim and so
			// may start after the delivery was seen (a CI run saw it).
			settled := checks.n.Load()
			holdsFor(t, 2*lease, "at most one settle check once the key is free", func() bool { return checks.n.Load() <= settled+1 })
		})
	}
}

// TestStopDoesNotWaitForGoneLaneCheck: a stopped lane's settle
// (lane.settleGone) runs on a goroutine that the dispatcher's stop waits
// for. Its check, on a server that does not answer, used to hold the stop
// up until the check's own 5 s bound ran out; the stop now ends it.
func TestStopDoesNotWaitForGoneLaneCheck(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	_, checks, _, _, d := lostKeyLane(t, e, 500*time.Millisecond)
	from := checks.n.Load()
	waitFor(t, 10*time.Second, "the settle's first checks", func() bool { return checks.n.Load() >= from+10 })
	checks.stallGone.Store(true)
	cs, err := e.client.Consumers(ctx, "app")
	if err != nil || len(cs) != 1 {
		t.Fatalf("consumers: %v, %v", cs, err)
	}
	if err := e.client.RemoveConsumer(ctx, "app", cs[0].ID); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the stopped lane's check to stall", func() bool { return checks.stalled.Load() == 1 })
	start := time.Now()
	d.stop()
	end := time.Now()
	took := end.Sub(start)
	checkEnd := time.Unix(0, checks.stalledTill.Load())
	t.Logf("the stop took %s with the stopped lane's check stalled, returning %s before the check's own bound",
		took.Round(time.Millisecond), checkEnd.Sub(end).Round(time.Millisecond))
	// Waiting for the check costs up to its 5s bound; 4s leaves a loaded
	// machine room for a whole stop while still telling the two apart.
	if took > 4*time.Second {
		t.Errorf("the stop took %s: it waited for the stopped lane's stalled check", took)
	}
	// The check's bound counts from its start, before the stop's: on a
	// machine slow to reach the stop, a stop that waited for it could
	// take under 4s. It would still end only when the check's own bound
	// did.
	if !end.Before(checkEnd) {
		t.Errorf("the stop returned %s after the stalled check's own bound ran out: it waited for the check", end.Sub(checkEnd).Round(time.Millisecond))
	}
}

// TestRetakenBusyKeySkipsSettleCheck: a lane whose busy key was lost
// settles by waiting until no session holds the key (needFree). Here a
// producer that saw the key is still open, so the settle goes on, and a
// new backlog makes the lane busy again: it takes the key on a new lock
// session. The settle's check cannot succeed while the lane holds the key
// itself, and it used to run on every busy pass all the same (18 – 23 in
// 150 ms). It now waits for the end of the busy period, whose unmark
// checks anyway; the busy lane's polls claim what the producer commits
// meanwhile, and every message is delivered.
func TestRetakenBusyKeySkipsSettleCheck(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.consumer(t, bellhop.ConsumerSpec{Queue: "orders", MaxInFlight: 2})
	rec := &recorder{result: func(context.Context, *bellhop.Message) error {
		time.Sleep(3 * time.Millisecond) // handler work: the backlogs last
		return nil
	}}
	mux := bellhop.NewMux()
	mux.Handle("app", "orders", rec)
	checks := &busyLockChecks{}
	startDispatcher(t, e.dsn, bellhop.DispatcherConfig{Resolver: mux, PollInterval: time.Hour, BusyWindow: 50 * time.Millisecond},
		func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = checks })
	backlog := func(n int) {
		t.Helper()
		msgs := make([]bellhop.NewMessage, n)
		for i := range msgs {
			msgs[i] = bellhop.NewMessage{Queue: "orders", Payload: []byte(`1`)}
		}
		if _, err := e.client.EnqueueMany(ctx, "app", msgs); err != nil {
			t.Fatal(err)
		}
	}
	keyHeld := func() bool { return e.count(t, busyKeyHeld+` AND mode = 'ExclusiveLock'`, "orders") == 1 }

	backlog(20)
	waitFor(t, 10*time.Second, "the busy key held", keyHeld)
	// A producer that saw the key and stays open: it holds the queue's
	// lock, so the lane's settle cannot end.
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := e.client.EnqueueTx(ctx, tx, "app", "orders", []byte(`"late"`), bellhop.EnqueueOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE application_name = 'bellhop-busy-locks' AND datname = current_database()`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the first backlog delivered", func() bool { return len(rec.deliveries()) == 20 })
	from := checks.n.Load()
	waitFor(t, 10*time.Second, "the settle checking the lock the producer holds", func() bool { return checks.n.Load() >= from+3 })

	// A second backlog: producers notify again (the killed backend is
	// gone), and the lane turns busy and takes the key anew.
	backlog(400)
	waitFor(t, 10*time.Second, "the busy key held again", keyHeld)
	if err := tx.Commit(ctx); err != nil { // the queue's lock is free from now on
		t.Fatal(err)
	}
	n0, c0 := checks.n.Load(), checks.claims.Load()
	var whileHeld, claimsHeld int64
	waitFor(t, 30*time.Second, "the end of the busy period", func() bool {
		n, c := checks.n.Load(), checks.claims.Load()
		if keyHeld() {
			whileHeld, claimsHeld = n-n0, c-c0
			return false
		}
		return true
	})
	t.Logf("while busy and holding the key: %d lock checks, %d claim passes", whileHeld, claimsHeld)
	if claimsHeld < 20 {
		t.Fatalf("only %d claim passes seen while the lane held the key: the test measured too little", claimsHeld)
	}
	if whileHeld > 0 {
		t.Errorf("%d lock checks in %d claim passes while the lane held the key itself; want none", whileHeld, claimsHeld)
	}
	waitFor(t, 10*time.Second, "every message delivered", func() bool { return len(rec.deliveries()) == 421 })
}

// TestSettleBehindOpenProducerBacksOff: a producer that saw the busy key
// and keeps its transaction open (an import, a request that enqueues and
// then calls something slow) holds the queue's lock shared, so the lane's
// settle check fails for as long as it stays open. The lane retried every
// 20 ms for as long as that lasted: two round trips each, about 95 a
// second, on a dispatcher with nothing to do. It now backs off, after the
// first tries, to one a second (docs/busy-marks.md, step 3), and the
// producer's message is still delivered within that second of its
// commit.
func TestSettleBehindOpenProducerBacksOff(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	rec, checks, _, stopStream := busyOrders(t, e, bellhop.DispatcherConfig{BusyWindow: 100 * time.Millisecond})
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	open, err := e.client.EnqueueTx(ctx, tx, "app", "orders", []byte(`"open"`), bellhop.EnqueueOptions{})
	if err != nil {
		t.Fatal(err)
	}
	n := stopStream()
	waitFor(t, 10*time.Second, "the stream delivered", func() bool { return len(rec.deliveries()) == n })
	from := checks.n.Load()
	waitFor(t, 10*time.Second, "the settle's first check", func() bool { return checks.n.Load() > from })

	// The first ten tries come within about 150 ms (lane.go,
	// settleQuickTries); then the backoff doubles from 40 ms to a second:
	// about seven checks in the next 3 s, against 150 at every 20 ms.
	waitFor(t, 10*time.Second, "the settle's quick tries", func() bool { return checks.n.Load() >= from+10 })
	checked := checks.n.Load()
	const window, limit = 3 * time.Second, 12
	holdsFor(t, window, fmt.Sprintf("at most %d settle checks in %s while the producer stays open", limit, window), func() bool {
		return checks.n.Load()-checked <= limit
	})
	t.Logf("%d settle checks in %s while the producer stayed open", checks.n.Load()-checked, window)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	committed := time.Now()
	at := deliveredBy(t, rec, open, 5*time.Second)
	// The next check comes within a second, succeeds, and the pass
	// after it claims the message; a second more for a loaded machine.
	if took := at.Sub(committed); took > 2*time.Second {
		t.Errorf("the open producer's message was delivered %s after its commit; want within the backoff's second and a margin", took.Round(time.Millisecond))
	}
}
