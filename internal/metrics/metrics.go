// Package metrics exposes a dispatcher's activity as Prometheus metrics.
// Recorder implements bellhop.Observer. New makes one and also registers
// collectors that read the listener's counters and the queue list at scrape
// time; RegisterLeases adds the counters of leasing at INSERT.
package metrics

import (
	"context"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/logthrottle"
	"github.com/bellhopq/bellhop/notify"
)

// Recorder holds the dispatcher's metrics. Labels are app and queue names
// that operators chose, by creating an app and registering a consumer:
// queues that producers name but no consumer serves share one series per
// app (NoConsumer). Payloads and secrets never become labels.
type Recorder struct {
	delivered, settled *prometheus.CounterVec
	reclaimed          *prometheus.CounterVec
	failed             *prometheus.CounterVec
	// seen holds the (app, queue) pairs whose outcome series exist.
	seen              sync.Map
	inFlight          *prometheus.GaugeVec
	toStart, toAck    *prometheus.HistogramVec
	handler           *prometheus.HistogramVec
	polls, pollsFound prometheus.Counter
}

var _ bellhop.FailureObserver = (*Recorder)(nil)

// New makes a Recorder and registers its metrics, the Go and process
// collectors, the listener's counters (from stats) and queue-depth gauges
// (from queues, called at most once per scrape; none if queues is nil)
// with reg. A failed read of
// the depths is logged to log. ctx bounds the reads of the depths: once
// it ends (a daemon's stop begins), a read in flight is cancelled and no
// other is made, so that a scrape holds neither the stop nor a database
// connection; the depths are then reported as not read
// (bellhop_queue_depths_ok 0). A scrape's own request cannot end a read:
// Prometheus collectors get no context.
func New(ctx context.Context, reg prometheus.Registerer, log zerolog.Logger, stats func() notify.Stats, queues func(context.Context) ([]bellhop.QueueInfo, error)) *Recorder {
	lq := []string{"app", "queue"}
	// Up to an hour: latency to start counts delays and retries' waits, and
	// a backlog of minutes read as 60 s at every quantile, the last
	// bucket's bound, when they stopped at a minute. Two buckets more a
	// histogram: six series a queue.
	buckets := []float64{.0005, .001, .002, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300, 3600}
	r := &Recorder{
		delivered: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "bellhop_delivered_total", Help: "Deliveries started, by app and queue."}, lq),
		settled: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "bellhop_settled_total", Help: "Deliveries settled, by outcome: written (acked, nacked, dead_lettered, released) or not (lease_lost: the lease was gone first, or a retried write found it gone, when the first try may have recorded the outcome, or an invoke delivery was removed with its consumer; write_failed: every write failed)."},
			append(lq, "outcome")),
		failed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "bellhop_statement_errors_total", Help: "The dispatcher's own statements that failed, by op: claim (a claim, or a lane's busy-lock check; counted once for each queue a failed claim served, up to 100 for one combined claim), poll (the fallback poll, or the scan after the listener connects), reclaim, reload (of the consumers), offer (with leasing at INSERT, an offer to lease the next message). Each is tried again; claim failures are logged at most once every 10s, offer failures at warn at most once a minute, the others each time."},
			[]string{"op"}),
		reclaimed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "bellhop_reclaimed_total", Help: "Expired leases returned by this dispatcher's reclaimer, by result (released, dead_lettered)."},
			[]string{"result"}),
		inFlight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "bellhop_in_flight", Help: "Delivery slots in use: a handler running, or its outcome waiting to be queued for writing."}, lq),
		toStart: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "bellhop_latency_to_start_seconds", Help: "From enqueued_at to the start of delivery (includes deliver_after delays and retries' waits). Compares the database's clock with the daemon's: keep them in sync (NTP).", Buckets: buckets}, lq),
		toAck: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "bellhop_latency_to_ack_seconds", Help: "From enqueued_at to the ack being written. Compares the database's clock with the daemon's: keep them in sync (NTP).", Buckets: buckets}, lq),
		handler: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "bellhop_handler_duration_seconds", Help: "How long handlers ran, for every delivery settled.", Buckets: buckets}, lq),
		polls: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "bellhop_fallback_polls_total", Help: "Fallback polls that reached the database (failed ones are logged)."}),
		pollsFound: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "bellhop_fallback_polls_found_work_total", Help: "Fallback polls that found work ready for a second or more on idle queues: non-zero means notifications were missed, or a dispatcher died (or could not wake the others) while it alone knew a retry's due time."}),
	}
	// Both results from the start, at 0: a series that appears only with
	// the first reclaim reads as a metric missing, and rate() over it
	// misses that first increase.
	r.reclaimed.WithLabelValues("released")
	r.reclaimed.WithLabelValues("dead_lettered")
	for _, op := range []bellhop.Operation{bellhop.OpClaim, bellhop.OpPoll, bellhop.OpReclaim, bellhop.OpReload, bellhop.OpOffer} {
		r.failed.WithLabelValues(string(op))
	}
	reg.MustRegister(r.delivered, r.settled, r.reclaimed, r.failed, r.inFlight, r.toStart, r.toAck, r.handler, r.polls, r.pollsFound,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		&listenerCollector{stats: stats})
	if queues != nil {
		reg.MustRegister(newDepthCollector(ctx, log, queues))
	}
	return r
}

// outcomes are those a delivery can settle with.
var outcomes = []bellhop.Outcome{bellhop.Acked, bellhop.Nacked, bellhop.DeadLettered, bellhop.Released, bellhop.LeaseLost, bellhop.WriteFailed}

// Delivered implements bellhop.Observer. A queue's first delivery makes
// its outcome series, at 0, as the reclaim's are: an outcome seen first
// (a queue's first dead letter) would otherwise start its series at 1,
// which increase() and rate() do not count, and an alert on them would
// miss it.
func (r *Recorder) Delivered(m *bellhop.Message) {
	type key struct{ app, queue string }
	if _, ok := r.seen.Load(key{m.App, m.Queue}); !ok {
		for _, o := range outcomes {
			r.settled.WithLabelValues(m.App, m.Queue, string(o))
		}
		r.seen.Store(key{m.App, m.Queue}, true)
	}
	r.delivered.WithLabelValues(m.App, m.Queue).Inc()
	r.inFlight.WithLabelValues(m.App, m.Queue).Inc()
	r.toStart.WithLabelValues(m.App, m.Queue).Observe(sinceEnqueued(m))
}

// sinceEnqueued is how long ago m was enqueued, by the daemon's clock,
// from enqueued_at, which the database's clock set. A database clock ahead
// of the daemon's makes it negative: counted as 0, since a negative sample
// would fall in the first bucket and lower the histogram's sum.
func sinceEnqueued(m *bellhop.Message) float64 {
	return max(time.Since(m.EnqueuedAt).Seconds(), 0)
}

// Settled implements bellhop.Observer.
func (r *Recorder) Settled(m *bellhop.Message, o bellhop.Outcome, handled time.Duration) {
	r.settled.WithLabelValues(m.App, m.Queue, string(o)).Inc()
	r.handler.WithLabelValues(m.App, m.Queue).Observe(handled.Seconds())
	if o == bellhop.Acked {
		r.toAck.WithLabelValues(m.App, m.Queue).Observe(sinceEnqueued(m))
	}
}

// Failed implements bellhop.FailureObserver.
func (r *Recorder) Failed(op bellhop.Operation) {
	r.failed.WithLabelValues(string(op)).Inc()
}

// Finished implements bellhop.Observer.
func (r *Recorder) Finished(m *bellhop.Message) {
	r.inFlight.WithLabelValues(m.App, m.Queue).Dec()
}

// Polled implements bellhop.Observer.
func (r *Recorder) Polled(missed int) {
	r.polls.Inc()
	if missed > 0 {
		r.pollsFound.Inc()
	}
}

// Reclaimed implements bellhop.Observer.
func (r *Recorder) Reclaimed(released, dead int64) {
	r.reclaimed.WithLabelValues("released").Add(float64(released))
	r.reclaimed.WithLabelValues("dead_lettered").Add(float64(dead))
}

type listenerCollector struct{ stats func() notify.Stats }

var (
	listenerConnected = prometheus.NewDesc("bellhop_listener_connected", "1 while the LISTEN connection is up.", nil, nil)
	listenerConnects  = prometheus.NewDesc("bellhop_listener_reconnects_total", "LISTEN connections made after the first.", nil, nil)
	listenerNotes     = prometheus.NewDesc("bellhop_listener_notifications_total", "Well-formed notifications received.", nil, nil)
	listenerGarbled   = prometheus.NewDesc("bellhop_listener_garbled_notifications_total", "Malformed notifications ignored.", nil, nil)
	listenerIgnored   = prometheus.NewDesc("bellhop_listener_ignored_notifications_total", "Notifications on a channel the listener has no handler for (a pooled session's leftover LISTEN), ignored with the connection kept.", nil, nil)
	listenerMissed    = prometheus.NewDesc("bellhop_listener_missed_heartbeats_total", "Heartbeats the listener did not hear in time, each followed by a reconnect.", nil, nil)
	listenerDeaf      = prometheus.NewDesc("bellhop_listener_deaf", "1 while the listener has missed two heartbeats and heard none (LISTEN through transaction pooling); /readyz fails meanwhile.", nil, nil)
)

func (c *listenerCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- listenerConnected
	ch <- listenerConnects
	ch <- listenerNotes
	ch <- listenerGarbled
	ch <- listenerIgnored
	ch <- listenerMissed
	ch <- listenerDeaf
}

func (c *listenerCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.stats()
	connected, deaf := 0.0, 0.0
	if s.Connected {
		connected = 1
	}
	if s.Deaf {
		deaf = 1
	}
	reconnects := 0.0
	if s.Connects > 0 {
		reconnects = float64(s.Connects - 1)
	}
	ch <- prometheus.MustNewConstMetric(listenerConnected, prometheus.GaugeValue, connected)
	ch <- prometheus.MustNewConstMetric(listenerConnects, prometheus.CounterValue, reconnects)
	ch <- prometheus.MustNewConstMetric(listenerNotes, prometheus.CounterValue, float64(s.Notifications))
	ch <- prometheus.MustNewConstMetric(listenerGarbled, prometheus.CounterValue, float64(s.Garbled))
	ch <- prometheus.MustNewConstMetric(listenerIgnored, prometheus.CounterValue, float64(s.Ignored))
	ch <- prometheus.MustNewConstMetric(listenerMissed, prometheus.CounterValue, float64(s.HungRestarts))
	ch <- prometheus.MustNewConstMetric(listenerDeaf, prometheus.GaugeValue, deaf)
}

// depthCollector reads the queue list once per scrape, and at most once a
// second however often it is scraped. When the read fails it reports no
// depths, and bellhop_queue_depths_ok 0: depths kept from an earlier read
// would look current while the database is gone. Why the read failed is
// logged, at most once every 10 s, as scrapes come every few seconds from
// each Prometheus server. Once stop ends, a read in flight is cancelled,
// which is logged once, at info, and no other is made.
type depthCollector struct {
	stop     context.Context
	queues   func(context.Context) ([]bellhop.QueueInfo, error)
	log      zerolog.Logger
	throttle *logthrottle.Throttle
	mu       sync.Mutex
	at       time.Time
	cached   []bellhop.QueueInfo
	ok       bool
}

// depthReadTimeout bounds a read of the queue depths.
const depthReadTimeout = 5 * time.Second

func newDepthCollector(stop context.Context, log zerolog.Logger, queues func(context.Context) ([]bellhop.QueueInfo, error)) *depthCollector {
	return &depthCollector{stop: stop, queues: queues, log: log, throttle: logthrottle.New(1, 10*time.Second)}
}

var depthDesc = prometheus.NewDesc("bellhop_queue_messages", "Messages per queue by state: ready, delayed, in_flight, dead.",
	[]string{"app", "queue", "state"}, nil)
var oldestDesc = prometheus.NewDesc("bellhop_queue_oldest_ready_seconds", "Age of the oldest ready message.",
	[]string{"app", "queue"}, nil)
var depthsOKDesc = prometheus.NewDesc("bellhop_queue_depths_ok",
	"1 if the last read of the queue depths succeeded; 0 if it failed, or, once a stop began, was not made: no depths are reported then.", nil, nil)

func (c *depthCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- depthDesc
	ch <- oldestDesc
	ch <- depthsOKDesc
}

func (c *depthCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	if time.Since(c.at) > time.Second {
		c.read()
	}
	qs, ok := c.cached, c.ok
	c.mu.Unlock()
	up := 0.0
	if ok {
		up = 1
	}
	ch <- prometheus.MustNewConstMetric(depthsOKDesc, prometheus.GaugeValue, up)
	// The queue list has a row per consumer: two consumers on one queue
	// (one moved there by SQL) give two rows with the same depths. Each
	// queue is sent once; a series sent twice failed the whole scrape.
	type key struct{ app, queue string }
	sent := make(map[key]bool, len(qs))
	// Queues without a consumer are named by producers alone, so that one
	// INSERT could make a series for each of thousands of names, on every
	// dispatcher: they are summed per app under the name NoConsumer.
	var apps []string
	unserved := map[string]*bellhop.QueueInfo{}
	for _, q := range qs {
		if q.ConsumerID == nil {
			u := unserved[q.App]
			if u == nil {
				u = &bellhop.QueueInfo{App: q.App, Queue: NoConsumer}
				unserved[q.App] = u
				apps = append(apps, q.App)
			}
			u.Ready += q.Ready
			u.Delayed += q.Delayed
			u.InFlight += q.InFlight
			u.Dead += q.Dead
			u.OldestReady = max(u.OldestReady, q.OldestReady)
			continue
		}
		k := key{q.App, q.Queue}
		if sent[k] {
			continue
		}
		sent[k] = true
		sendDepths(ch, q)
	}
	for _, app := range apps {
		sendDepths(ch, *unserved[app])
	}
}

// NoConsumer is the queue label under which the depths of an app's queues
// that have no consumer are summed (the oldest ready message being the
// oldest of them all). No queue can have this name.
const NoConsumer = "(no consumer)"

// sendDepths sends q's depth gauges.
func sendDepths(ch chan<- prometheus.Metric, q bellhop.QueueInfo) {
	for state, v := range map[string]int64{"ready": q.Ready, "delayed": q.Delayed, "in_flight": q.InFlight, "dead": q.Dead} {
		ch <- prometheus.MustNewConstMetric(depthDesc, prometheus.GaugeValue, float64(v), q.App, q.Queue, state)
	}
	ch <- prometheus.MustNewConstMetric(oldestDesc, prometheus.GaugeValue, q.OldestReady.Seconds(), q.App, q.Queue)
}

// read reads the depths into the cache, unless stop has ended; c.mu is held.
func (c *depthCollector) read() {
	c.cached, c.ok, c.at = nil, false, time.Now()
	if c.stop.Err() != nil {
		return
	}
	begun := time.Now()
	ctx, cancel := context.WithTimeout(c.stop, depthReadTimeout)
	qs, err := c.queues(ctx)
	cancel()
	c.at = time.Now()
	if err == nil {
		c.cached, c.ok = qs, true
		return
	}
	if c.stop.Err() != nil {
		c.log.Info().Err(err).Stringer("after", time.Since(begun).Round(time.Millisecond)).
			Msg("the stop cut short a read of the queue depths for /metrics; bellhop_queue_depths_ok is 0 and no depths are read from now on")
		return
	}
	if ok, held := c.throttle.Allow(); ok {
		c.log.Warn().Err(err).Int("held_back", held).
			Msg("could not read the queue depths for /metrics; bellhop_queue_depths_ok is 0 (logged at most once every 10s; held_back counts the failures not logged)")
	}
}

// RegisterLeases adds the counters of leasing at INSERT
// (bellhop.DispatcherConfig.LeaseAtInsert), read from stats at scrape time.
func RegisterLeases(reg prometheus.Registerer, stats func() bellhop.LeaseStats) {
	reg.MustRegister(&leaseCollector{stats: stats})
}

type leaseCollector struct{ stats func() bellhop.LeaseStats }

var (
	offersDesc = prometheus.NewDesc("bellhop_offers_total",
		"Offers made by idle queues for producers to lease their next message to this dispatcher (INSERTs that succeeded).", nil, nil)
	leasedDesc = prometheus.NewDesc("bellhop_leased_at_insert_total",
		"Messages producers leased to this dispatcher, by how it learned of them: notification, or recovered: found by token before its notification was heard (after a reconnect, a poll, or at a clean stop, which releases it).",
		[]string{"found"}, nil)
)

func (c *leaseCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- offersDesc
	ch <- leasedDesc
}

func (c *leaseCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.stats()
	ch <- prometheus.MustNewConstMetric(offersDesc, prometheus.CounterValue, float64(s.Offers))
	ch <- prometheus.MustNewConstMetric(leasedDesc, prometheus.CounterValue, float64(s.Leased), "notification")
	ch <- prometheus.MustNewConstMetric(leasedDesc, prometheus.CounterValue, float64(s.Recovered), "recovered")
}
