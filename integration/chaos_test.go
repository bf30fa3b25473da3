package integration

// TestChaosSoak: three `bellhop run` processes deliver a steady stream of
// messages to a flaky HTTP consumer while faults are injected one at a
// time: kill -9 of a dispatcher (restarted), pg_terminate_backend of the
// listeners and of the pools, a fast and an immediate PostgreSQL restart,
// and a 5 s SIGSTOP freeze of the server. A ledger of every delivery, as
// the consumer saw it, is checked at the end: nothing lost, nothing handled
// twice at once while its lease held, and every redelivery explained.
//
// Short form (CI, about 75 s): go test ./integration -run TestChaosSoak -v
// Long form:  go test ./integration -run TestChaosSoak -v -timeout 0 -soak=30m
//
// See soakPlan for the knobs, and the report printed at the end (-v).

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"flag"
	"fmt"
	"hash/fnv"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgcluster"
)

var (
	soakFlag         = flag.Duration("soak", 0, "TestChaosSoak and TestChaosSoakLeasing: run the long form for this long (30m or more; needs -timeout 0 or a larger -timeout); 0 runs the short CI form")
	soakMessagesFlag = flag.Int("soak.messages", 0, "TestChaosSoak and TestChaosSoakLeasing: messages to enqueue (0: 14,000 in the short form, 50,000 in the long form)")
	soakRaceFlag     = flag.Bool("soak.race", false, "TestChaosSoak and TestChaosSoakLeasing: build the bellhop binary with -race too (slower; the test's own code always runs under go test's -race if given)")
	soakSeedFlag     = flag.Uint64("soak.seed", 0, "TestChaosSoak and TestChaosSoakLeasing: seed of the consumer's failure choices and the producer (0: random)")
	soakLogDirFlag   = flag.String("soak.logdir", "", "TestChaosSoak and TestChaosSoakLeasing: keep the dispatchers' logs in this directory, as <test>-<dispatcher>.log, appended to: use an empty one (default: a temp dir, removed)")
)

const (
	chaosApp         = "chaos"
	chaosQueues      = 50
	chaosDispatchers = 3
	// chaosVT is every consumer's visibility timeout: short, so that leases
	// lost to a fault expire (and their messages come back) within the
	// test. The push request timeout is vt less a fifth (2.4 s).
	chaosVT = 3 * time.Second
	// chaosHang is how long a "hung" consumer request holds on: past the
	// visibility timeout. The dispatcher gives up at 2.4 s (its request
	// timeout, inside the lease) and retries.
	chaosHang = 4 * time.Second
	// chaosPoll is the dispatchers' fallback poll. Besides catching lost
	// notifications, the poll is how a dispatcher's reclaimer learns of
	// leases taken by *other* dispatchers (a killed one's), and it carries
	// the listener's heartbeat (a hung listener after a freeze). At 2 s a
	// killed dispatcher's messages come back within vt + 2 s, not vt + 1 min.
	chaosPoll        = 2 * time.Second
	chaosMaxAttempts = 3
	// Consumer retry backoff: fast, so retries stay within the test.
	chaosBackoffBase = 100 * time.Millisecond
	chaosBackoffCap  = time.Second
	// Of the deliveries, hangPermil per 10,000 hang and failPermil more
	// answer HTTP 500.
	hangPer10k = 100
	failPer10k = 1000
	// chaosSlack is how long after a fault's window (recovery + vt) a
	// redelivery it caused may still start: a lease lost to the fault
	// expires at most vt after recovery, and the reclaimer that returns it
	// may learn of it only at its next fallback poll (2 s, ±10%); a second
	// covers the claim and the push (and a loaded CI machine).
	chaosSlack = chaosPoll*11/10 + time.Second
	// chaosOfferTTL is how long an offer lives without its dispatcher's
	// poll (Dispatcher.offerTTL: three polls).
	chaosOfferTTL = 3 * chaosPoll
	// chaosLeasers is how many of the dispatchers lease at INSERT in
	// TestChaosSoakLeasing; the others claim after notifications.
	chaosLeasers = 2
	// chaosDelayedPct of messages are enqueued with a 0.5-3 s delay.
	chaosDelayedPct = 10
)

// soakPlan sizes a run.
type soakPlan struct {
	long       bool
	duration   time.Duration // how long faults are injected for (at least one full cycle)
	messages   int
	produceFor time.Duration // the producer spreads the messages over this long
	gap        time.Duration // quiet time between one fault's recovery and the next fault
}

func planSoak() soakPlan {
	p := soakPlan{duration: 55 * time.Second, messages: 14_000, produceFor: 60 * time.Second, gap: 4 * time.Second}
	if *soakFlag > 0 {
		p = soakPlan{long: true, duration: *soakFlag, messages: 50_000, gap: 20 * time.Second}
		p.produceFor = max(p.duration-time.Minute, p.duration*9/10)
	}
	if *soakMessagesFlag > 0 {
		p.messages = *soakMessagesFlag
	}
	return p
}

// ledgerEntry is one delivery as the consumer saw it.
type ledgerEntry struct {
	ID          uuid.UUID
	Seq         int
	Queue       string
	Attempt     int
	MaxAttempts int
	Start, End  time.Time
	Status      int  // what the consumer answered (a hang answers 500 if anyone is still listening)
	Hang        bool // the consumer held on (chaosHang, or until the dispatcher gave up)
	Abandoned   bool // the dispatcher hung up first
}

func (e ledgerEntry) ok() bool { return e.Status >= 200 && e.Status <= 299 }

func (e ledgerEntry) String() string {
	what := strconv.Itoa(e.Status)
	if e.Hang {
		what = "hang"
		if e.Abandoned {
			what += " (abandoned by the dispatcher)"
		}
	}
	return fmt.Sprintf("attempt %d/%d %s..%s %s", e.Attempt, e.MaxAttempts,
		e.Start.Format("15:04:05.000"), e.End.Format("15:04:05.000"), what)
}

// chaosConsumer serves every consumer URL (/c/<queue>), checks each
// request's signature, fails or hangs on some and records all of them.
type chaosConsumer struct {
	seed    uint64
	secrets atomic.Pointer[map[string]string] // queue -> signing secret

	mu     sync.Mutex
	ledger []ledgerEntry
	bad    []string // requests that failed verification

	oks    atomic.Int64
	lastOK atomic.Int64 // unix nanos of the latest 2xx's start
}

// fate decides, reproducibly from the seed, what the consumer does with
// one attempt of one message, independently for each attempt.
func (c *chaosConsumer) fate(id uuid.UUID, attempt int) (hang, fail bool) {
	h := fnv.New64a()
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], c.seed)
	h.Write(b[:])
	h.Write(id[:])
	binary.LittleEndian.PutUint64(b[:], uint64(attempt))
	h.Write(b[:])
	// FNV-1a alone mixes its last bytes poorly: the sums of one message's
	// attempts differ by a small multiple of a constant, so their
	// remainders were tied to each other, and no message ever failed all
	// three attempts (dead letters came from faults only). splitmix64's
	// finaliser makes the attempts' fates independent.
	x := h.Sum64()
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	r := x % 10_000
	return r < hangPer10k, r >= hangPer10k && r < hangPer10k+failPer10k
}

func (c *chaosConsumer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	e := ledgerEntry{Start: time.Now()}
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	e.Queue = strings.TrimPrefix(r.URL.Path, "/c/")
	secret := (*c.secrets.Load())[e.Queue]
	if err == nil {
		err = bellhop.VerifyPush(secret, r.Header, body, time.Now(), 0)
	}
	if err != nil {
		c.mu.Lock()
		c.bad = append(c.bad, fmt.Sprintf("%s %s: %v", r.Method, r.URL.Path, err))
		c.mu.Unlock()
		http.Error(w, "bad request", http.StatusUnauthorized)
		return
	}
	e.ID, _ = uuid.Parse(r.Header.Get(bellhop.HeaderMessageID))
	e.Attempt, _ = strconv.Atoi(r.Header.Get(bellhop.HeaderAttempt))
	e.MaxAttempts, _ = strconv.Atoi(r.Header.Get(bellhop.HeaderMaxAttempts))
	var p struct{ Seq int }
	if json.Unmarshal(body, &p) != nil {
		p.Seq = -1
	}
	e.Seq = p.Seq
	hang, fail := c.fate(e.ID, e.Attempt)
	switch {
	case hang:
		e.Hang, e.Status = true, http.StatusInternalServerError
		timer := time.NewTimer(chaosHang)
		select {
		case <-timer.C:
		case <-r.Context().Done():
			e.Abandoned = true
		}
		timer.Stop()
	case fail:
		e.Status = http.StatusInternalServerError
	default:
		e.Status = http.StatusOK
	}
	e.End = time.Now()
	c.mu.Lock()
	c.ledger = append(c.ledger, e)
	c.mu.Unlock()
	if e.ok() {
		c.oks.Add(1)
		c.lastOK.Store(e.Start.UnixNano())
	}
	w.WriteHeader(e.Status)
}

func (c *chaosConsumer) snapshot() ([]ledgerEntry, []string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.ledger), slices.Clone(c.bad)
}

// committedMsg is a message the producer knows is committed.
type committedMsg struct {
	ID    uuid.UUID
	Seq   int
	Queue string
	Delay time.Duration
	At    time.Time // when EnqueueMany returned success
}

// chaosProducer enqueues seq 0..n-1 in small batches at a steady rate and
// retries a failed batch (with fresh ids: the client makes them) until it
// commits. A batch that failed may have committed anyway (the error came
// after COMMIT reached the server); its seqs are remembered as ambiguous,
// so that deliveries of such unknown ids can be told from strays.
type chaosProducer struct {
	client *bellhop.Client
	rng    *rand.Rand // used by run's goroutine only

	mu        sync.Mutex
	committed []committedMsg
	ambiguous map[int]bool
	errs      int
	firstErrs []string
}

const produceBatch = 10

func (p *chaosProducer) run(ctx context.Context, n int, over time.Duration) {
	batches := (n + produceBatch - 1) / produceBatch
	interval := over / time.Duration(batches)
	start := time.Now()
	for b := range batches {
		if wait := time.Until(start.Add(time.Duration(b) * interval)); wait > 0 {
			select {
			case <-ctx.Done():
				return
			case <-time.After(wait):
			}
		}
		var seqs []int
		for s := b * produceBatch; s < min(n, (b+1)*produceBatch); s++ {
			seqs = append(seqs, s)
		}
		queues := make([]string, len(seqs))
		delays := make([]time.Duration, len(seqs))
		for i := range seqs {
			queues[i] = fmt.Sprintf("q%02d", p.rng.IntN(chaosQueues))
			if p.rng.IntN(100) < chaosDelayedPct {
				delays[i] = 500*time.Millisecond + time.Duration(p.rng.Int64N(int64(2500*time.Millisecond)))
			}
		}
		for try := 0; ; try++ {
			msgs := make([]bellhop.NewMessage, len(seqs))
			for i, s := range seqs {
				msgs[i] = bellhop.NewMessage{Queue: queues[i], Payload: fmt.Appendf(nil, `{"seq":%d}`, s),
					Options: bellhop.EnqueueOptions{Delay: delays[i]}}
			}
			actx, cancel := context.WithTimeout(ctx, 5*time.Second)
			ids, err := p.client.EnqueueMany(actx, chaosApp, msgs)
			cancel()
			if ctx.Err() != nil {
				return
			}
			if err == nil {
				now := time.Now()
				p.mu.Lock()
				for i, s := range seqs {
					p.committed = append(p.committed, committedMsg{ID: ids[i], Seq: s, Queue: queues[i], Delay: delays[i], At: now})
				}
				p.mu.Unlock()
				break
			}
			p.mu.Lock()
			p.errs++
			if len(p.firstErrs) < 5 {
				p.firstErrs = append(p.firstErrs, err.Error())
			}
			for _, s := range seqs {
				p.ambiguous[s] = true
			}
			p.mu.Unlock()
			// Retry pacing during an outage, not synchronisation.
			select {
			case <-ctx.Done():
				return
			case <-time.After(min(time.Duration(try+1)*100*time.Millisecond, time.Second)):
			}
		}
	}
}

func (p *chaosProducer) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.committed)
}

// faultRec is one injected fault.
type faultRec struct {
	Kind   string
	Detail string
	Start  time.Time // injected
	End    time.Time // removed: process restarted, server back, thawed
	Ready  time.Time // every dispatcher ready again (and re-listening, if the fault cut its listener)
	// FirstOK is the first 2xx delivery that started after End (from the
	// ledger); zero if none.
	FirstOK time.Time
	// offers: a killed dispatcher's offers outlive it by up to this long,
	// while another leasing dispatcher holds the lease key, and producers
	// lease messages to it that come back after their lease. The long
	// form found such messages committed 5.0 - 5.4 s after the restart
	// and first delivered, on attempt 2, 3 s later.
	offers time.Duration
}

const (
	faultKill      = "kill -9 dispatcher"
	faultTermListn = "terminate listeners"
	faultTermPool  = "terminate pool conns"
	faultFast      = "restart fast"
	faultImmediate = "restart immediate"
	faultFreeze    = "freeze 5s (SIGSTOP)"
)

// windowHas reports whether a redelivery whose predecessor started at
// prev and which itself started at cur falls in f's window: the fault came
// between the two, and the redelivery no later than the window's end. For
// a killed leasing dispatcher, "between" lasts as long as its offers: a
// message committed after the restart can still be leased to one of them
// and come back after its lease ("attempts the consumer never saw").
func (f *faultRec) windowHas(prev, cur time.Time) bool {
	return !prev.After(f.Ready.Add(f.offers)) && !cur.Before(f.Start) && !cur.After(f.windowEnd())
}

// windowEnd is the latest a redelivery caused by f may start: recovery +
// vt (+ the reclaim slack), and for a killed leasing dispatcher its offers'
// life on top (chaosOfferTTL).
func (f *faultRec) windowEnd() time.Time {
	return f.Ready.Add(chaosVT + chaosSlack + f.offers)
}

// chaosRig is everything a soak runs.
type chaosRig struct {
	t        *testing.T
	cluster  *pgcluster.Cluster
	admin    *pgxpool.Pool
	ds       []*daemon
	consumer *chaosConsumer
	faults   []*faultRec
	leasers  int // dispatchers 0 .. leasers-1 lease at INSERT
	// leased and recovered sum the lease counters of each dispatcher
	// over its lives (a restart zeroes them): leases heard of by
	// notification, and leases found by token before their notification was heard.
	leased, recovered []float64
}

// countLeases adds dispatcher i's lease counters, as it reports them now,
// to the sums: before it is killed, and at the end.
func (r *chaosRig) countLeases(i int) {
	if r.leased == nil {
		r.leased, r.recovered = make([]float64, len(r.ds)), make([]float64, len(r.ds))
	}
	text, err := r.ds[i].scrape()
	if err != nil {
		r.t.Errorf("%s: metrics: %v", r.ds[i].name, err)
		return
	}
	n, okN := metric(text, `bellhop_leased_at_insert_total{found="notification"}`)
	m, okM := metric(text, `bellhop_leased_at_insert_total{found="recovered"}`)
	if !okN || !okM {
		r.t.Errorf("%s: no lease counters in its metrics", r.ds[i].name)
		return
	}
	r.leased[i] += n
	r.recovered[i] += m
}

// TestChaosSoak injects faults into three dispatchers and their server
// while a producer runs, and accounts for every message from the
// consumer's ledger: none lost, none delivered twice at once under a live
// lease, every redelivery and every dead letter after attempts the
// consumer never saw explained by a fault or a failed delivery, and no
// wake-up lost outside a fault's window: no delivery that became ready
// and started outside every window waited over lateAfter (a second; the
// short form's windows leave few such deliveries, the long form many)
// while the dispatchers were demonstrably at work, or over chaosSlack at
// all (see lostWakeup: a stall of the whole machine makes deliveries late
// too, and is not what the soak is after). Every late delivery is
// listed in the report. Fallback polls that found work no notification
// announced are reported, not failed (see scanLogs).
func TestChaosSoak(t *testing.T) { runChaosSoak(t, 0) }

// TestChaosSoakLeasing is TestChaosSoak with two of the three dispatchers
// leasing at INSERT (docs/lease-at-insert.md), the third claiming after
// notifications: offers made, taken, withdrawn by a poll, lost with the
// UNLOGGED table in an immediate restart, left by a killed dispatcher, and
// leases whose notification went to a terminated listener.
func TestChaosSoakLeasing(t *testing.T) { runChaosSoak(t, chaosLeasers) }

func runChaosSoak(t *testing.T, leasers int) {
	plan := planSoak()
	if dl, ok := t.Deadline(); ok && time.Until(dl) < plan.duration+3*time.Minute {
		t.Fatalf("the soak needs about %s but the test deadline is in %s: pass -timeout 0 (or larger)",
			plan.duration+3*time.Minute, time.Until(dl).Round(time.Second))
	}
	seed := *soakSeedFlag
	if seed == 0 {
		seed = rand.Uint64()
	}
	form := "short"
	if plan.long {
		form = "long"
	}
	t.Logf("chaos soak, %s form: %d messages over %s, faults for %s, %d of %d dispatchers leasing at INSERT, seed %d (-soak.seed to repeat the consumer's choices)",
		form, plan.messages, plan.produceFor, plan.duration, leasers, chaosDispatchers, seed)

	bin := buildBellhop(t, *soakRaceFlag)
	cluster := ownCluster(t, nil)
	dsn := cluster.TCPConnString("bellhop")
	mustCLI(t, bin, dsn, "migrate")
	mustCLI(t, bin, dsn, "app", "create", chaosApp)

	ctx := context.Background()
	newPool := func(name string, conns int32) *pgxpool.Pool {
		pc, err := pgxpool.ParseConfig(dsn)
		if err != nil {
			t.Fatal(err)
		}
		pc.MaxConns = conns
		pc.ConnConfig.RuntimeParams["application_name"] = name
		pool, err := pgxpool.NewWithConfig(ctx, pc)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		return pool
	}
	admin := newPool("chaos-admin", 2)
	client := bellhop.NewClient(newPool("chaos-producer", 4))

	cons := &chaosConsumer{seed: seed}
	cons.secrets.Store(&map[string]string{})
	srv := httptest.NewServer(cons)
	t.Cleanup(srv.Close)
	secrets := map[string]string{}
	for q := range chaosQueues {
		name := fmt.Sprintf("q%02d", q)
		c, err := client.RegisterConsumer(ctx, bellhop.ConsumerSpec{
			App: chaosApp, Queue: name, URL: srv.URL + "/c/" + name,
			VisibilityTimeout: chaosVT, MaxAttempts: chaosMaxAttempts,
			BackoffBase: chaosBackoffBase, BackoffCap: chaosBackoffCap,
		})
		if err != nil {
			t.Fatal(err)
		}
		secrets[name] = c.Secret
	}
	cons.secrets.Store(&secrets)

	rig := &chaosRig{t: t, cluster: cluster, admin: admin, consumer: cons, leasers: leasers}
	for i := range chaosDispatchers {
		args := []string{"--poll-interval", chaosPoll.String(), "--log-level", "info"}
		if i < leasers {
			args = append(args, "--lease-at-insert")
		}
		d := newDaemon(t, fmt.Sprintf("dispatcher-%d", i+1), bin, dsn, args...)
		if *soakLogDirFlag != "" {
			// One file per test and dispatcher: the two soaks' logs must
			// not mix, or each would read the other's lines as its own.
			d.logPath = filepath.Join(*soakLogDirFlag, t.Name()+"-"+d.name+".log")
		}
		if err := d.start(); err != nil {
			t.Fatal(err)
		}
		rig.ds = append(rig.ds, d)
	}
	t.Cleanup(func() {
		for _, d := range rig.ds {
			_ = d.stop(15 * time.Second)
			if t.Failed() {
				t.Logf("%s log (tail):\n%s", d.name, d.logTail(40))
			}
		}
	})
	rig.waitReady(nil, time.Time{}, 30*time.Second, "dispatchers to start")
	pids := make([]int, len(rig.ds))
	for i, d := range rig.ds {
		pids[i] = d.pid()
	}

	// The producer runs while the faults are injected.
	prod := &chaosProducer{client: client, rng: rand.New(rand.NewPCG(seed, 1)), ambiguous: map[int]bool{}}
	pctx, stopProducer := context.WithCancel(ctx)
	defer stopProducer()
	produced := make(chan struct{})
	soakStart := time.Now()
	go func() {
		defer close(produced)
		prod.run(pctx, plan.messages, plan.produceFor)
	}()

	// Faults, one at a time, in cycles, while the producer runs (and at
	// least one full cycle).
	kinds := []string{faultKill, faultTermListn, faultTermPool, faultFast, faultImmediate, faultFreeze}
faults:
	for n := 0; ; n++ {
		if n >= len(kinds) && time.Since(soakStart) >= plan.duration {
			break
		}
		select {
		case <-produced:
			if n >= len(kinds) {
				break faults
			}
		default:
		}
		rig.inject(kinds[n%len(kinds)], n/len(kinds))
		// Quiet time: traffic flows undisturbed before the next fault.
		time.Sleep(plan.gap)
	}
	faultsDone := time.Now()
	select {
	case <-produced:
	case <-time.After(plan.produceFor + 5*time.Minute):
		t.Fatalf("the producer did not finish; committed %d of %d", prod.count(), plan.messages)
	}
	producedAt := time.Now()

	// Drain: every committed message settles.
	drainLimit := 2 * time.Minute
	deadline := time.Now().Add(drainLimit)
	for {
		var left int
		err := admin.QueryRow(ctx, `SELECT count(*) FROM queue_messages`).Scan(&left)
		if err == nil && left == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d messages still in queue_messages %s after the producer finished (err %v)", left, drainLimit, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	drained := time.Now()

	// Every dispatcher is still the process we started (bar the killed
	// ones, restarted by the test), is ready, and stops cleanly.
	for i, d := range rig.ds {
		if ex := d.unexpectedExits(); len(ex) > 0 {
			t.Errorf("%s crashed: %v", d.name, ex)
		}
		if !d.ready() {
			t.Errorf("%s not ready at the end", d.name)
		}
		if !rig.wasKilled(i) && d.pid() != pids[i] {
			t.Errorf("%s was restarted although never killed", d.name)
		}
	}
	for i := range leasers {
		rig.countLeases(i)
	}
	for _, d := range rig.ds {
		if err := d.stop(15 * time.Second); err != nil {
			t.Errorf("%s: graceful stop: %v", d.name, err)
		}
	}
	if leasers > 0 {
		var total float64
		for i := range leasers {
			t.Logf("%s leased at INSERT: %.0f heard by notification, %.0f recovered by token",
				rig.ds[i].name, rig.leased[i], rig.recovered[i])
			total += rig.leased[i] + rig.recovered[i]
		}
		if total == 0 {
			t.Error("no message was leased at INSERT: the soak did not test leasing")
		}
	}
	ledger, bad := cons.snapshot()

	rep := rig.analyse(ledger, prod, rig.deadLetters())
	rig.scanLogs(rep)
	rep.seed, rep.form = seed, form
	rep.elapsed = drained.Sub(soakStart)
	rep.faultPhase = faultsDone.Sub(soakStart)
	rep.drain = drained.Sub(producedAt)
	rep.badSignatures = len(bad)
	t.Log("\n" + rep.String())

	if len(bad) > 0 {
		t.Errorf("%d requests failed signature verification, e.g. %s", len(bad), bad[0])
	}
	rep.check(t)
	if n := min(len(rep.unexplained), 10); n > 0 {
		t.Logf("what the dispatchers logged about the first %d unexplained redeliveries (info and up; a delivery that went well logs nothing):\n%s",
			n, rig.linesAbout(rep.unexplained[:n]))
	}
}

// uuidPattern finds a message id in a ledger finding.
var uuidPattern = regexp.MustCompile(`[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}`)

// linesAbout returns every dispatcher's log lines that name the message
// each finding is about (its first id), so that a failed soak says which
// dispatcher did what to it, even when its logs were in a removed temp
// dir.
func (r *chaosRig) linesAbout(findings []string) string {
	logs := make([][]string, len(r.ds))
	for i, d := range r.ds {
		b, err := os.ReadFile(d.logPath)
		if err != nil {
			r.t.Errorf("read %s: %v", d.logPath, err)
			continue
		}
		logs[i] = strings.Split(string(b), "\n")
	}
	var b strings.Builder
	for _, f := range findings {
		id := uuidPattern.FindString(f)
		if id == "" {
			continue
		}
		fmt.Fprintf(&b, "  %s:\n", id)
		found := 0
		for i, lines := range logs {
			for _, line := range lines {
				if found < 20 && strings.Contains(line, id) {
					fmt.Fprintf(&b, "    %s %s\n", r.ds[i].name, line)
					found++
				}
			}
		}
		if found == 0 {
			b.WriteString("    (nothing)\n")
		}
	}
	return b.String()
}

// wasKilled reports whether dispatcher i was kill -9'd.
func (r *chaosRig) wasKilled(i int) bool {
	for _, f := range r.faults {
		if f.Kind == faultKill && f.Detail == r.ds[i].name {
			return true
		}
	}
	return false
}

// listenerReconnects reads each dispatcher's reconnect counter; -1 where
// it cannot be read.
func (r *chaosRig) listenerReconnects() []float64 {
	out := make([]float64, len(r.ds))
	for i, d := range r.ds {
		out[i] = -1
		if text, err := d.scrape(); err == nil {
			if v, ok := metric(text, "bellhop_listener_reconnects_total"); ok {
				out[i] = v
			}
		}
	}
	return out
}

// waitReady waits until every dispatcher answers /readyz 200 and, if
// before is set, has reconnected its listener since (its reconnect
// counter passed before[i]): a fault that cut the listener is only over
// once the listener is back, which /readyz alone may not show yet if the
// dispatcher has not noticed the cut. It returns when that happened.
func (r *chaosRig) waitReady(before []float64, since time.Time, limit time.Duration, what string) time.Time {
	r.t.Helper()
	deadline := time.Now().Add(limit)
	for {
		all := true
		for i, d := range r.ds {
			if !d.ready() {
				all = false
				break
			}
			if before != nil && before[i] >= 0 {
				text, err := d.scrape()
				v, ok := metric(text, "bellhop_listener_reconnects_total")
				if err != nil || !ok || v <= before[i] {
					all = false
					break
				}
			}
		}
		if all {
			return time.Now()
		}
		if time.Now().After(deadline) {
			var states []string
			for _, d := range r.ds {
				states = append(states, fmt.Sprintf("%s ready=%t", d.name, d.ready()))
			}
			r.t.Fatalf("timed out after %s waiting for %s (%s since the fault ended): %s", limit, what,
				time.Since(since).Round(time.Millisecond), strings.Join(states, ", "))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// inject runs one fault and waits for the dispatchers to recover from it
// by themselves (only a killed dispatcher is restarted, by the test), then
// for deliveries to go on.
func (r *chaosRig) inject(kind string, cycle int) {
	t := r.t
	t.Helper()
	ctx := context.Background()
	f := &faultRec{Kind: kind}
	var before []float64 // reconnect counters, for faults that cut the listeners
	terminate := func(app string) int {
		var n int
		if err := r.admin.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
			WHERE application_name = $1 AND datname = current_database()`, app).Scan(&n); err != nil {
			t.Fatalf("%s: %v", kind, err)
		}
		return n
	}
	switch kind {
	case faultKill:
		i := cycle % len(r.ds)
		d := r.ds[i]
		f.Detail = d.name
		if i < r.leasers {
			f.offers = chaosOfferTTL
			r.countLeases(i)
		}
		f.Start = time.Now()
		if err := d.kill9(); err != nil {
			t.Fatal(err)
		}
		if err := d.start(); err != nil {
			t.Fatalf("restart %s: %v", d.name, err)
		}
		f.End = time.Now()
	case faultTermListn:
		before = r.listenerReconnects()
		f.Start = time.Now()
		n := terminate("bellhop-listener")
		f.End = time.Now()
		f.Detail = fmt.Sprintf("%d backends", n)
		if n != len(r.ds) {
			t.Errorf("%s: terminated %d listener backends, want %d", kind, n, len(r.ds))
		}
	case faultTermPool:
		f.Start = time.Now()
		n := terminate("bellhop-dispatcher")
		f.End = time.Now()
		f.Detail = fmt.Sprintf("%d backends", n)
		if n < len(r.ds) {
			t.Errorf("%s: terminated %d pool backends, want at least one per dispatcher (%d)", kind, n, len(r.ds))
		}
	case faultFast, faultImmediate:
		before = r.listenerReconnects()
		mode := "fast"
		if kind == faultImmediate {
			mode = "immediate"
		}
		f.Start = time.Now()
		rctx, cancel := context.WithTimeout(ctx, time.Minute)
		err := r.cluster.Restart(rctx, mode)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		f.End = time.Now()
		f.Detail = fmt.Sprintf("server down %s", f.End.Sub(f.Start).Round(time.Millisecond))
	case faultFreeze:
		f.Start = time.Now()
		if err := r.cluster.Signal(syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		time.Sleep(5 * time.Second) // the fault itself
		if err := r.cluster.Signal(syscall.SIGCONT); err != nil {
			t.Fatal(err)
		}
		f.End = time.Now()
	}
	r.faults = append(r.faults, f)
	f.Ready = r.waitReady(before, f.End, 60*time.Second, "recovery from "+kind)
	t.Logf("fault %d: %s %s: recovered %s after it ended", len(r.faults), kind, f.Detail,
		f.Ready.Sub(f.End).Round(time.Millisecond))
	// Progress: a delivery succeeds after recovery, or there is nothing
	// left to deliver.
	deadline := time.Now().Add(30 * time.Second)
	for time.Unix(0, r.consumer.lastOK.Load()).Before(f.Ready) {
		var left int
		if err := r.admin.QueryRow(ctx, `SELECT count(*) FROM queue_messages`).Scan(&left); err == nil && left == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no successful delivery within 30s of recovering from %s", kind)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// soakReport is what the ledger says.
type soakReport struct {
	seed                    uint64
	form                    string
	elapsed, faultPhase     time.Duration
	drain                   time.Duration
	committed, extras       int
	producerErrs            int
	producerErrSample       []string
	deliveries, oks, fails  int
	hangs, abandoned        int
	acked, dead             int
	redeliveries            int
	causes                  map[string]int
	overlapsImmediate       int
	overlapDetails          []string
	maxLag                  map[string]time.Duration // by fault kind: latest explained redelivery after the fault's recovery
	examples                map[string][]string
	faults                  []*faultRec
	badSignatures           int
	lost, badDead, unknowns []string
	unexplained             []string
	deadAfterOK             int
	// deadUnseen counts dead letters whose last attempts (or all of them)
	// the consumer never saw, each inside a fault's window, by the
	// fault's kind in deadUnseenCauses.
	deadUnseen         int
	deadUnseenCauses   map[string]int
	deadUnseenExamples []string
	logCounts          map[string]int // dispatcher warnings and errors, by level and message
	missedPolls        int            // fallback polls that found ready work on idle queues
	missedPollsOutside []string       // ... outside every fault window
	// waits are, for deliveries whose readiness and start both fall
	// outside every fault window, how long after the message became
	// ready (committed and due, or its retry backoff over and, after a
	// hang, its lease) the delivery
	// started; late lists those that waited over lateAfter, and
	// lostWakeups those of them that lostWakeup judges lost wake-ups.
	waits       []time.Duration
	samples     []waitSample
	late        []string
	lateSamples []waitSample
	lostWakeups []string
}

// waitSample is a delivery's wait, away from faults.
type waitSample struct {
	ready, start time.Time
	// enqueued: ready is when the enqueue returned (its delay added), at
	// most the enqueue's round trip after the message was ready. A
	// retry's is its longest backoff: it may have been ready up to half
	// that earlier.
	enqueued bool
	desc     string
}

func (w waitSample) wait() time.Duration { return w.start.Sub(w.ready) }

// lateAfter marks a delivery that waited for something other than a
// notification: normally a ready message starts within milliseconds; one
// that waits this long was most likely picked up by the 2 s fallback poll
// (or a reclaim), i.e. its wake-up was lost, or the machine stalled.
const lateAfter = time.Second

// freshAfter and promptWithin pick the deliveries that show the
// dispatchers at work while a late one waited (lostWakeup): ready and
// started freshAfter or more after it was ready, within promptWithin of
// each other.
const (
	freshAfter   = lateAfter / 4
	promptWithin = lateAfter / 4
)

// lostWakeup judges l, a delivery that waited over lateAfter. Such a
// wait is what a lost wake-up looks like, but also what one stall of a
// shared CI machine does to every delivery ready as it begins, and in a
// soak's minutes on such a machine a stall of a second is no rare event.
// A stall holds back every delivery, a lost wake-up one. So l counts only if,
// while it waited, the dispatchers demonstrably worked: a message became
// ready freshAfter or more after l (by when l would have started, had
// nothing held it up) and started within promptWithin of that, and
// lateAfter - freshAfter or more before l did. A stall that held l up
// began before l would have started, so that message started after the
// stall ended (nothing starts during one), and l then waited on, 750 ms
// or more, with the dispatchers at work. Its start is checked as well as
// its readiness: an enqueue that committed before a stall may return
// only after it, its delivery first.
//
// A lost wake-up that the fallback poll (2 s, ±10%) catches over
// lateAfter later (and the fresher message's own few milliseconds) fails
// the soak so, as before, as long as other messages flow, as they do
// while the producer runs. With nothing to compare it with, a
// delivery that waited over chaosSlack (the poll's longest interval and
// a second) always counts: the poll missed it too, and a stall that long
// is rare. Only first deliveries serve as the fresher message: their
// readiness is known to within the enqueue's round trip, a retry's only
// to within half its backoff.
func (rep *soakReport) lostWakeup(l waitSample, byStart []waitSample) bool {
	if l.wait() > chaosSlack {
		return true
	}
	from := l.ready.Add(freshAfter)
	to := l.start.Add(-(lateAfter - freshAfter))
	i, _ := slices.BinarySearchFunc(byStart, from, func(w waitSample, at time.Time) int { return w.start.Compare(at) })
	for ; i < len(byStart) && !byStart[i].start.After(to); i++ {
		if e := byStart[i]; e.enqueued && !e.ready.Before(from) && e.wait() <= promptWithin && e.wait() >= -promptWithin {
			return true
		}
	}
	return false
}

// judgeLate fills lostWakeups from lateSamples.
func (rep *soakReport) judgeLate() {
	byStart := slices.Clone(rep.samples)
	slices.SortFunc(byStart, func(a, b waitSample) int { return a.start.Compare(b.start) })
	for _, l := range rep.lateSamples {
		if rep.lostWakeup(l, byStart) {
			rep.lostWakeups = append(rep.lostWakeups, l.desc)
		}
	}
}

// maxBackoff is the longest retry delay after attempt (see backoff.Delay).
func maxBackoff(attempt int) time.Duration {
	d := chaosBackoffBase
	for i := 1; i < attempt && d < chaosBackoffCap; i++ {
		d *= 2
	}
	return min(d, chaosBackoffCap)
}

// inFaultWindow reports whether [from, to] touches some fault's window.
func (r *chaosRig) inFaultWindow(from, to time.Time) bool {
	for _, f := range r.faults {
		if !to.Before(f.Start) && !from.After(f.windowEnd()) {
			return true
		}
	}
	return false
}

// wait records how long e waited after it became ready at ready.
func (rep *soakReport) wait(r *chaosRig, e ledgerEntry, ready time.Time, what string) {
	if r.inFaultWindow(ready, e.Start) {
		return
	}
	w := e.Start.Sub(ready)
	rep.waits = append(rep.waits, w)
	sample := waitSample{ready: ready, start: e.Start, enqueued: what == waitEnqueued}
	rep.samples = append(rep.samples, sample)
	if w > lateAfter {
		sample.desc = fmt.Sprintf("%s %s: started %s after it was ready (%s)", e.ID, e, w.Round(time.Millisecond), what)
		rep.late = append(rep.late, sample.desc)
		rep.lateSamples = append(rep.lateSamples, sample)
	}
}

// waitEnqueued is wait's what for a first delivery, ready when its
// enqueue returned (and its delay ran out).
const waitEnqueued = "enqueued"

// deadRow is a dead letter, with its seq (a message committed behind the
// producer's back has a seq but an id the producer never learned) and
// when it died (died_at: the server's clock, the test's too).
type deadRow struct {
	attempt, max, seq int
	diedAt            time.Time
}

func (r *chaosRig) deadLetters() map[uuid.UUID]deadRow {
	t := r.t
	dead := map[uuid.UUID]deadRow{}
	rows, err := r.admin.Query(context.Background(),
		`SELECT id, attempt, max_attempts, coalesce((payload->>'seq')::int, -1), died_at FROM dead_letters`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id uuid.UUID
		var d deadRow
		if err := rows.Scan(&id, &d.attempt, &d.max, &d.seq, &d.diedAt); err != nil {
			t.Fatal(err)
		}
		dead[id] = d
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return dead
}

// analyse checks every message's fate (from the ledger and the dead
// letters) and explains every redelivery.
func (r *chaosRig) analyse(ledger []ledgerEntry, prod *chaosProducer, dead map[uuid.UUID]deadRow) *soakReport {
	prod.mu.Lock()
	committed := slices.Clone(prod.committed)
	ambiguous := prod.ambiguous
	rep := &soakReport{committed: len(committed), producerErrs: prod.errs, producerErrSample: prod.firstErrs,
		causes: map[string]int{}, faults: r.faults, deliveries: len(ledger),
		maxLag: map[string]time.Duration{}, examples: map[string][]string{}, deadUnseenCauses: map[string]int{}}
	prod.mu.Unlock()

	known := make(map[uuid.UUID]committedMsg, len(committed))
	for _, m := range committed {
		known[m.ID] = m
	}
	byMsg := map[uuid.UUID][]ledgerEntry{}
	for _, e := range ledger {
		byMsg[e.ID] = append(byMsg[e.ID], e)
		switch {
		case e.ok():
			rep.oks++
		case e.Hang:
			rep.hangs++
			if e.Abandoned {
				rep.abandoned++
			}
		default:
			rep.fails++
		}
	}
	for _, f := range r.faults {
		for _, e := range ledger {
			if e.ok() && !e.Start.Before(f.End) && (f.FirstOK.IsZero() || e.Start.Before(f.FirstOK)) {
				f.FirstOK = e.Start
			}
		}
	}

	// The messages to account for: the committed ones, plus any the
	// ledger or dead_letters show that were committed by a batch whose
	// enqueue reported an error.
	all := map[uuid.UUID]int{} // id -> seq
	for _, m := range committed {
		all[m.ID] = m.Seq
	}
	addExtra := func(id uuid.UUID, seq int) {
		if _, ok := all[id]; ok {
			return
		}
		if !ambiguous[seq] {
			rep.unknowns = append(rep.unknowns, fmt.Sprintf("%s (seq %d)", id, seq))
			return
		}
		all[id] = seq
		rep.extras++
	}
	for id, es := range byMsg {
		addExtra(id, es[0].Seq)
	}
	for id, d := range dead {
		addExtra(id, d.seq)
	}

	for id := range all {
		es := byMsg[id]
		sort.Slice(es, func(i, j int) bool { return es[i].Start.Before(es[j].Start) })
		var lastOK *ledgerEntry
		for i := range es {
			if es[i].ok() {
				lastOK = &es[i]
			}
		}
		if d, isDead := dead[id]; isDead {
			rep.dead++
			if d.attempt != d.max || d.max != chaosMaxAttempts {
				rep.badDead = append(rep.badDead, fmt.Sprintf("%s dead at attempt %d of %d", id, d.attempt, d.max))
			}
			if lastOK != nil {
				// The consumer took it, then it died anyway: only a lost
				// ack (a fault) can do that.
				rep.deadAfterOK++
				if r.faultFor(lastOK.Start, lastOK.Start.Add(chaosVT), "") == nil {
					rep.unexplained = append(rep.unexplained, fmt.Sprintf("%s: dead-lettered after a 2xx outside any fault window: %s", id, lastOK))
				}
			}
			// It died at an attempt the consumer never saw: its last
			// attempts came after the last delivery the consumer saw, or
			// the consumer saw none at all. Only a fault between that
			// delivery (or the commit) and the death explains attempts
			// that were claimed but never pushed.
			if len(es) == 0 || es[len(es)-1].Attempt < d.attempt {
				from, seen := time.Time{}, "never delivered"
				if len(es) > 0 {
					from, seen = es[len(es)-1].Start, "last seen on "+es[len(es)-1].String()
				} else if m, ok := known[id]; ok {
					from = m.At.Add(-5 * time.Second) // the enqueue attempt that committed may have started before
				}
				detail := fmt.Sprintf("%s: dead-lettered at attempt %d/%d at %s, %s", id, d.attempt, d.max,
					d.diedAt.Format("15:04:05.000"), seen)
				if f := r.faultFor(from, d.diedAt, ""); f != nil {
					rep.deadUnseen++
					rep.deadUnseenCauses[f.Kind]++
					if len(rep.deadUnseenExamples) < 2 {
						rep.deadUnseenExamples = append(rep.deadUnseenExamples, detail)
					}
				} else {
					rep.unexplained = append(rep.unexplained, detail+": attempts the consumer never saw, not in any fault window")
				}
			}
		} else if lastOK != nil {
			rep.acked++
		} else {
			rep.lost = append(rep.lost, fmt.Sprintf("%s (seq %d): gone, not dead-lettered, never answered 2xx; deliveries %v", id, all[id], es))
		}

		// Latency from ready to start, away from faults.
		if len(es) > 0 && es[0].Attempt == 1 {
			if m, ok := known[id]; ok {
				rep.wait(r, es[0], m.At.Add(m.Delay), waitEnqueued)
			}
		}
		for i := 1; i < len(es); i++ {
			if prev, cur := es[i-1], es[i]; cur.Attempt == prev.Attempt+1 && !prev.ok() {
				ready, what := prev.End.Add(maxBackoff(prev.Attempt)), "retry backoff over"
				if prev.Hang {
					// An abandoned push is retried once its lease is
					// over too (nack.sql); it started a little after
					// its claim, so this is a little late, not early.
					if end := prev.Start.Add(chaosVT); end.After(ready) {
						ready, what = end, "the hung attempt's lease over"
					}
				}
				rep.wait(r, cur, ready, what)
			}
		}

		// Redeliveries. A first delivery on attempt > 1 follows attempts
		// the consumer never saw: explained only by a fault after commit.
		if len(es) > 0 && es[0].Attempt > 1 {
			rep.redeliveries++
			from := time.Time{}
			if m, ok := known[id]; ok {
				from = m.At.Add(-5 * time.Second) // the enqueue attempt that committed may have started before
			}
			if f := r.faultFor(from, es[0].Start, ""); f != nil {
				rep.explain(f, "attempts the consumer never saw", es[0].Start,
					fmt.Sprintf("%s: first seen on %s", id, es[0]))
			} else {
				rep.unexplained = append(rep.unexplained, fmt.Sprintf("%s: first seen on %s", id, es[0]))
			}
		}
		for i := 1; i < len(es); i++ {
			prev, cur := es[i-1], es[i]
			rep.redeliveries++
			// Two deliveries at once while the earlier one's lease held.
			overlapped := false
			for _, e := range es[:i] {
				if cur.Start.Before(e.End) && cur.Start.Before(e.Start.Add(chaosVT)) {
					overlapped = true
					detail := fmt.Sprintf("%s: %s overlaps %s", id, cur, e)
					if f := r.faultFor(e.Start, cur.Start, faultImmediate); f != nil {
						rep.overlapsImmediate++
						rep.overlapDetails = append(rep.overlapDetails, detail)
						rep.explain(f, "overlapping delivery (lost claim)", cur.Start, detail)
					} else {
						rep.unexplained = append(rep.unexplained, "concurrent deliveries under a live lease: "+detail)
					}
					break
				}
			}
			if overlapped {
				continue
			}
			switch {
			case cur.Attempt == prev.Attempt+1 && prev.Hang:
				rep.causes["after a hang past the lease (retry by design)"]++
			case cur.Attempt == prev.Attempt+1 && !prev.ok():
				rep.causes["after HTTP 500 (retry by design)"]++
			default:
				what := "redelivered with the same attempt (lost claim)"
				switch {
				case prev.ok() && cur.Attempt == prev.Attempt+1:
					what = "after a 2xx (ack not recorded)"
				case cur.Attempt > prev.Attempt+1:
					what = "attempts the consumer never saw"
				case cur.Attempt < prev.Attempt:
					what = "attempt number went back (lost commits)"
				}
				// A claim that was delivered and then vanished, so that the
				// same or an earlier attempt comes round again, is a commit
				// the server lost: only an immediate restart does that
				// (synchronous_commit=off). Anything else any fault can do.
				kind := ""
				if cur.Attempt <= prev.Attempt {
					kind = faultImmediate
				}
				if f := r.faultFor(prev.Start, cur.Start, kind); f != nil {
					rep.explain(f, what, cur.Start, fmt.Sprintf("%s: %s then %s", id, prev, cur))
				} else {
					rep.unexplained = append(rep.unexplained, fmt.Sprintf("%s: %s, not in any fault window: %s then %s", id, what, prev, cur))
				}
			}
		}
	}
	rep.judgeLate()
	return rep
}

// faultFor returns the fault (of kind, if not "") whose window holds a
// redelivery from prev to cur, or nil.
func (r *chaosRig) faultFor(prev, cur time.Time, kind string) *faultRec {
	// The latest fault first: windows of faults injected close together
	// overlap, and the latest one before the redelivery is its likeliest
	// cause (and gives the honest lag).
	for i := len(r.faults) - 1; i >= 0; i-- {
		if f := r.faults[i]; (kind == "" || f.Kind == kind) && f.windowHas(prev, cur) {
			return f
		}
	}
	return nil
}

func (rep *soakReport) explain(f *faultRec, what string, at time.Time, detail string) {
	cause := "fault window: " + f.Kind + ": " + what
	rep.causes[cause]++
	if len(rep.examples[cause]) < 2 {
		rep.examples[cause] = append(rep.examples[cause], detail)
	}
	lag := at.Sub(f.Ready)
	if lag > rep.maxLag[f.Kind] {
		rep.maxLag[f.Kind] = lag
	}
}

func (rep *soakReport) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "=== chaos soak (%s form, seed %d): %s in all; faults for %s; drained %s after the last enqueue\n",
		rep.form, rep.seed, rep.elapsed.Round(time.Millisecond), rep.faultPhase.Round(time.Millisecond), rep.drain.Round(time.Millisecond))
	fmt.Fprintf(&b, "messages: %d committed as reported, %d more committed by batches whose enqueue failed (ambiguous commits); producer errors retried: %d\n",
		rep.committed, rep.extras, rep.producerErrs)
	for _, e := range rep.producerErrSample {
		fmt.Fprintf(&b, "    e.g. %s\n", e)
	}
	fmt.Fprintf(&b, "outcome: %d acked, %d dead-lettered (%d of them after a 2xx whose ack was lost), %d lost\n",
		rep.acked, rep.dead, rep.deadAfterOK, len(rep.lost))
	fmt.Fprintf(&b, "deliveries: %d (2xx %d, HTTP 500 %d, hangs %d of which %d abandoned by the dispatcher); bad signatures %d\n",
		rep.deliveries, rep.oks, rep.fails, rep.hangs, rep.abandoned, rep.badSignatures)
	fmt.Fprintf(&b, "dead letters after attempts the consumer never saw (claimed, never pushed), each in a fault's window: %d\n", rep.deadUnseen)
	deadKinds := make([]string, 0, len(rep.deadUnseenCauses))
	for k := range rep.deadUnseenCauses {
		deadKinds = append(deadKinds, k)
	}
	sort.Strings(deadKinds)
	for _, k := range deadKinds {
		fmt.Fprintf(&b, "    %6d  fault window: %s\n", rep.deadUnseenCauses[k], k)
	}
	for _, e := range rep.deadUnseenExamples {
		fmt.Fprintf(&b, "              e.g. %s\n", e)
	}
	fmt.Fprintf(&b, "redeliveries: %d\n", rep.redeliveries)
	causes := make([]string, 0, len(rep.causes))
	for c := range rep.causes {
		causes = append(causes, c)
	}
	sort.Strings(causes)
	for _, c := range causes {
		fmt.Fprintf(&b, "    %6d  %s\n", rep.causes[c], c)
		for _, e := range rep.examples[c] {
			fmt.Fprintf(&b, "              e.g. %s\n", e)
		}
	}
	fmt.Fprintf(&b, "    %6d  unexplained\n", len(rep.unexplained))
	fmt.Fprintf(&b, "overlapping deliveries inside immediate-restart windows (synchronous_commit=off losing a claim): %d\n", rep.overlapsImmediate)
	for _, d := range rep.overlapDetails {
		fmt.Fprintf(&b, "    %s\n", d)
	}
	fmt.Fprintf(&b, "latest fault-explained redelivery after its fault's recovery (a window allows vt %s + slack %s, + offers %s for a killed leasing dispatcher):",
		chaosVT, chaosSlack, chaosOfferTTL)
	kinds := make([]string, 0, len(rep.maxLag))
	for k := range rep.maxLag {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	for _, k := range kinds {
		fmt.Fprintf(&b, " %s %s;", k, rep.maxLag[k].Round(time.Millisecond))
	}
	b.WriteString("\n")
	if n := len(rep.waits); n == 0 {
		b.WriteString("ready -> delivery start: no delivery away from every fault window (the short form's windows cover the run)\n")
	} else {
		w := slices.Clone(rep.waits)
		slices.Sort(w)
		q := func(p float64) time.Duration { return w[min(n-1, int(float64(n)*p))].Round(10 * time.Microsecond) }
		fmt.Fprintf(&b, "ready -> delivery start (ready: the enqueue call returned, so it can be negative), %d deliveries away from faults: p50 %s, p99 %s, p99.9 %s, max %s; %d waited over %s (a lost wake-up the fallback poll caught, or a stall), %d of them lost wake-ups (see lostWakeup)\n",
			n, q(0.5), q(0.99), q(0.999), w[n-1].Round(10*time.Microsecond), len(rep.late), lateAfter, len(rep.lostWakeups))
		for _, l := range rep.late[:min(len(rep.late), 5)] {
			fmt.Fprintf(&b, "    %s\n", l)
		}
	}
	fmt.Fprintf(&b, "fallback polls that found work no notification announced: %d (%d outside fault windows)\n",
		rep.missedPolls, len(rep.missedPollsOutside))
	for _, m := range rep.missedPollsOutside[:min(len(rep.missedPollsOutside), 5)] {
		fmt.Fprintf(&b, "    %s\n", m)
	}
	fmt.Fprintf(&b, "dispatcher warnings and errors (all processes, all runs):\n")
	msgs := make([]string, 0, len(rep.logCounts))
	for m := range rep.logCounts {
		msgs = append(msgs, m)
	}
	sort.Slice(msgs, func(i, j int) bool { return rep.logCounts[msgs[i]] > rep.logCounts[msgs[j]] })
	for _, m := range msgs {
		fmt.Fprintf(&b, "    %6d  %s\n", rep.logCounts[m], m)
	}
	fmt.Fprintf(&b, "faults injected: %d\n", len(rep.faults))
	for i, f := range rep.faults {
		firstOK := "none"
		if !f.FirstOK.IsZero() {
			firstOK = f.FirstOK.Sub(f.End).Round(time.Millisecond).String()
		}
		fmt.Fprintf(&b, "    #%-2d %-22s %-18s lasted %-8s all ready %-8s after; first 2xx %s after\n", i+1, f.Kind, f.Detail,
			f.End.Sub(f.Start).Round(time.Millisecond), f.Ready.Sub(f.End).Round(time.Millisecond), firstOK)
	}
	return b.String()
}

// check fails the test on every broken invariant.
func (rep *soakReport) check(t *testing.T) {
	t.Helper()
	show := func(what string, items []string) {
		if len(items) == 0 {
			return
		}
		t.Errorf("%d %s, e.g.:\n  %s", len(items), what, strings.Join(items[:min(len(items), 10)], "\n  "))
	}
	show("messages lost", rep.lost)
	show("dead letters not at their last attempt", rep.badDead)
	show("deliveries or dead letters of messages nobody committed", rep.unknowns)
	show("unexplained redeliveries or dead letters", rep.unexplained)
	show(fmt.Sprintf("deliveries away from every fault window that started over %s after they were ready while fresher messages were delivered promptly, or over %s after (lost wake-ups)", lateAfter, chaosSlack), rep.lostWakeups)
	if rep.committed == 0 || rep.acked == 0 {
		t.Errorf("nothing was delivered: committed %d, acked %d", rep.committed, rep.acked)
	}
	if rep.fails == 0 || rep.hangs == 0 {
		t.Errorf("the consumer never failed (%d) or never hung (%d): the soak did not test retries", rep.fails, rep.hangs)
	}
	// The consumer fails every attempt of about 0.11^3 of the messages:
	// some 18 of the short form's 14,000. (Not checked for a run too small
	// to expect 10.)
	bad := float64(hangPer10k+failPer10k) / 10_000
	if want := float64(rep.committed) * math.Pow(bad, chaosMaxAttempts); want >= 10 && rep.dead == 0 {
		t.Errorf("no message was dead-lettered (%.0f expected): the soak did not test running out of attempts", want)
	}
}

// scanLogs counts the dispatchers' warnings and errors by message, and
// places each fallback poll that found unannounced work against the fault
// windows: one outside them is a wake-up that went missing without a
// fault. Reported, not failed: dispatchers count only work ready for a
// second (missedGrace), which leaves out another dispatcher's nack timer
// firing as the poll runs, the race seen in earlier soaks, but a poll can
// still race a release's or a reclaim's notification.
func (r *chaosRig) scanLogs(rep *soakReport) {
	rep.logCounts = map[string]int{}
	for _, d := range r.ds {
		b, err := os.ReadFile(d.logPath)
		if err != nil {
			r.t.Errorf("read %s: %v", d.logPath, err)
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			if line == "" {
				continue
			}
			var rec struct {
				Level   string    `json:"level"`
				Message string    `json:"message"`
				Time    time.Time `json:"time"`
			}
			if err := json.Unmarshal([]byte(line), &rec); err != nil {
				rep.logCounts["(not JSON) "+line[:min(len(line), 80)]]++
				if strings.Contains(line, "DATA RACE") || strings.HasPrefix(line, "panic:") || strings.HasPrefix(line, "fatal error:") {
					r.t.Errorf("%s: %s (see %s)", d.name, line, d.logPath)
				}
				continue
			}
			if rec.Level != "warn" && rec.Level != "error" && rec.Level != "fatal" && rec.Level != "panic" {
				continue
			}
			rep.logCounts[rec.Level+": "+rec.Message]++
			if strings.HasPrefix(rec.Message, "fallback poll found ready work") {
				rep.missedPolls++
				inside := false
				for _, f := range r.faults {
					if !rec.Time.Before(f.Start) && !rec.Time.After(f.windowEnd()) {
						inside = true
						break
					}
				}
				if !inside {
					rep.missedPollsOutside = append(rep.missedPollsOutside, d.name+" "+rec.Time.Format("15:04:05.000"))
				}
			}
		}
	}
}
