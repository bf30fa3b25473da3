package metrics

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/syncbuf"
	"github.com/bellhopq/bellhop/internal/validate"
	"github.com/bellhopq/bellhop/notify"
)

// TestDepthsWhenTheReadFails: a failed read of the queue depths reports no
// depths and bellhop_queue_depths_ok 0. The collector kept serving the
// last good read, so /metrics showed a queue's messages as ready while the
// database was down.
func TestDepthsWhenTheReadFails(t *testing.T) {
	fail := false
	c := newDepthCollector(context.Background(), zerolog.Nop(), func(context.Context) ([]bellhop.QueueInfo, error) {
		if fail {
			return nil, errors.New("database down")
		}
		return []bellhop.QueueInfo{{App: "shop", Queue: "orders", Ready: 3}}, nil
	})
	for _, step := range []struct {
		fail   bool
		ok     float64
		depths int // four states and the oldest ready age per queue
	}{
		{false, 1, 5},
		{true, 0, 0},
		{false, 1, 5},
	} {
		fail = step.fail
		if ok, depths := scrapeDepths(t, c); ok != step.ok || depths != step.depths {
			t.Errorf("read failing %v: bellhop_queue_depths_ok %v and %d depth series, want %v and %d", step.fail, ok, depths, step.ok, step.depths)
		}
	}
}

// scrapeDepths collects c now (not a second after its last read) and
// returns bellhop_queue_depths_ok (-1 if absent) and the number of the
// other series.
func scrapeDepths(t *testing.T, c *depthCollector) (ok float64, depths int) {
	t.Helper()
	c.mu.Lock()
	c.at = time.Time{}
	c.mu.Unlock()
	ch := make(chan prometheus.Metric, 16)
	c.Collect(ch)
	close(ch)
	ok = -1
	for m := range ch {
		if m.Desc() == depthsOKDesc {
			var pb dto.Metric
			if err := m.Write(&pb); err != nil {
				t.Fatal(err)
			}
			ok = pb.GetGauge().GetValue()
			continue
		}
		depths++
	}
	return ok, depths
}

// TestDepthsReadFailureLogged: why a read of the queue depths failed is
// logged at warn, once for two failed scrapes within 10 s, the second
// held back. It was not logged at all: bellhop_queue_depths_ok went to 0
// and nothing said why.
func TestDepthsReadFailureLogged(t *testing.T) {
	var logs bytes.Buffer
	fail := true
	c := newDepthCollector(context.Background(), zerolog.New(&logs), func(context.Context) ([]bellhop.QueueInfo, error) {
		if fail {
			return nil, errors.New("database down (test)")
		}
		return []bellhop.QueueInfo{{App: "shop", Queue: "orders"}}, nil
	})
	for i := range 2 {
		if ok, _ := scrapeDepths(t, c); ok != 0 {
			t.Fatalf("failed scrape %d: bellhop_queue_depths_ok %v, want 0", i+1, ok)
		}
	}
	lines := strings.Split(strings.TrimSpace(logs.String()), "\n")
	if len(lines) != 1 || lines[0] == "" {
		t.Fatalf("logged %q for two failed reads within 10s, want one line", logs.String())
	}
	var line map[string]any
	if err := json.Unmarshal([]byte(lines[0]), &line); err != nil {
		t.Fatalf("log line %q: %v", lines[0], err)
	}
	if line["level"] != "warn" || line["error"] != "database down (test)" || line["held_back"] != float64(0) {
		t.Errorf("logged %v, want level warn, the read's error and held_back 0", line)
	}
	fail = false
	if ok, depths := scrapeDepths(t, c); ok != 1 || depths != 5 {
		t.Errorf("after recovery: bellhop_queue_depths_ok %v and %d depth series, want 1 and 5", ok, depths)
	}
}

// TestDepthsReadCutShortByStop: a read of the depths in flight when the
// collector's context ends (a daemon's stop begins) is cancelled at once,
// reported as bellhop_queue_depths_ok 0 and logged once, at info; a scrape
// after it reads nothing. The read ran on for its own 5s against a server
// that did not answer, holding a connection of the daemon's pool, and the
// daemon's exit, past the stop's bound.
func TestDepthsReadCutShortByStop(t *testing.T) {
	var logs syncbuf.Buffer
	stop, cancel := context.WithCancel(context.Background())
	defer cancel()
	entered := make(chan struct{}, 1)
	var reads atomic.Int32
	c := newDepthCollector(stop, zerolog.New(&logs), func(ctx context.Context) ([]bellhop.QueueInfo, error) {
		reads.Add(1)
		entered <- struct{}{}
		<-ctx.Done() // a server that does not answer
		return nil, ctx.Err()
	})
	done := make(chan float64, 1)
	go func() {
		ok, _ := scrapeDepths(t, c)
		done <- ok
	}()
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the scrape did not read the depths within 10s")
	}
	cancel()
	select {
	case ok := <-done:
		if ok != 0 {
			t.Errorf("the scrape cut short: bellhop_queue_depths_ok %v, want 0", ok)
		}
	case <-time.After(2 * time.Second):
		t.Fatalf("the scrape had not returned 2s after the stop began")
	}
	if ok, depths := scrapeDepths(t, c); ok != 0 || depths != 0 {
		t.Errorf("a scrape after the stop began: bellhop_queue_depths_ok %v and %d depth series, want 0 and 0", ok, depths)
	}
	if n := reads.Load(); n != 1 {
		t.Errorf("%d reads of the depths, want 1: none once the stop began", n)
	}
	lines := strings.Split(strings.TrimSpace(logs.String()), "\n")
	var line map[string]any
	if len(lines) != 1 || json.Unmarshal([]byte(lines[0]), &line) != nil {
		t.Fatalf("logged %q, want one JSON line", logs.String())
	}
	if msg, _ := line["message"].(string); line["level"] != "info" || line["error"] != "context canceled" ||
		line["after"] == nil || !strings.Contains(msg, "the stop cut short a read of the queue depths") {
		t.Errorf("logged %v, want at info that the stop cut the read short, with its error and when", line)
	}
}

// TestLatencyClockAhead: a message whose enqueued_at is ahead of the
// daemon's clock (the database's clock ahead) is counted as 0 s in the
// latency histograms. It was a negative sample, which lowered _sum.
func TestLatencyClockAhead(t *testing.T) {
	reg := prometheus.NewRegistry()
	r := New(context.Background(), reg, zerolog.Nop(), func() notify.Stats { return notify.Stats{} },
		func(context.Context) ([]bellhop.QueueInfo, error) { return nil, nil })
	m := &bellhop.Message{App: "shop", Queue: "orders", EnqueuedAt: time.Now().Add(20 * time.Millisecond)}
	r.Delivered(m)
	r.Settled(m, bellhop.Acked, time.Millisecond)
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	seen := 0
	for _, f := range families {
		if n := f.GetName(); n != "bellhop_latency_to_start_seconds" && n != "bellhop_latency_to_ack_seconds" {
			continue
		}
		for _, s := range f.GetMetric() {
			seen++
			h := s.GetHistogram()
			if h.GetSampleCount() != 1 || h.GetSampleSum() != 0 {
				t.Errorf("%s: %d samples summing to %v, want 1 of 0", f.GetName(), h.GetSampleCount(), h.GetSampleSum())
			}
		}
	}
	if seen != 2 {
		t.Errorf("found %d latency histograms, want 2", seen)
	}
}

// TestLatencyBucketsReachAnHour: a message enqueued 4 minutes ago, a
// backlog or a retry's wait, falls in the latency histograms' 300 s
// bucket, not only in +Inf: the buckets stopped at 60 s, where every
// quantile of such a backlog read 60 s (found by the metrics review). The
// handler's 40 minutes fall in the 3,600 s bucket.
func TestLatencyBucketsReachAnHour(t *testing.T) {
	reg := prometheus.NewRegistry()
	r := New(context.Background(), reg, zerolog.Nop(), func() notify.Stats { return notify.Stats{} },
		func(context.Context) ([]bellhop.QueueInfo, error) { return nil, nil })
	m := &bellhop.Message{App: "shop", Queue: "orders", EnqueuedAt: time.Now().Add(-4 * time.Minute)}
	r.Delivered(m)
	r.Settled(m, bellhop.Acked, 40*time.Minute)
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]float64{ // the least bucket that holds the sample
		"bellhop_latency_to_start_seconds": 300, "bellhop_latency_to_ack_seconds": 300, "bellhop_handler_duration_seconds": 3600,
	}
	seen := 0
	for _, f := range families {
		bound, ok := want[f.GetName()]
		if !ok {
			continue
		}
		for _, s := range f.GetMetric() {
			seen++
			hasBound := false
			for _, b := range s.GetHistogram().GetBucket() {
				hasBound = hasBound || b.GetUpperBound() == bound
				if got, in := b.GetCumulativeCount(), b.GetUpperBound() >= bound; (got == 1) != in {
					t.Errorf("%s: bucket le=%v counts %d, want %d", f.GetName(), b.GetUpperBound(), got, map[bool]int{true: 1}[in])
				}
			}
			if !hasBound {
				t.Errorf("%s has no bucket le=%v", f.GetName(), bound)
			}
		}
	}
	if seen != len(want) {
		t.Errorf("found %d histograms, want %d", seen, len(want))
	}
}

// TestListenerMetrics: the listener's state and counters, as its Stats
// give them; a deaf listener (LISTEN through transaction pooling) shows as
// bellhop_listener_deaf 1, beside the heartbeats it missed.
func TestListenerMetrics(t *testing.T) {
	names := map[*prometheus.Desc]string{
		listenerConnected: "connected", listenerConnects: "reconnects", listenerNotes: "notifications",
		listenerGarbled: "garbled", listenerIgnored: "ignored", listenerMissed: "missed", listenerDeaf: "deaf",
	}
	for _, tc := range []struct {
		name  string
		stats notify.Stats
		want  map[string]float64
	}{
		{"healthy", notify.Stats{Connected: true, Connects: 1, Notifications: 7},
			map[string]float64{"connected": 1, "reconnects": 0, "notifications": 7, "garbled": 0, "ignored": 0, "missed": 0, "deaf": 0}},
		{"deaf", notify.Stats{Connected: true, Connects: 3, HungRestarts: 2, Deaf: true, Garbled: 1},
			map[string]float64{"connected": 1, "reconnects": 2, "notifications": 0, "garbled": 1, "ignored": 0, "missed": 2, "deaf": 1}},
		{"reconnecting after a miss", notify.Stats{Connects: 2, HungRestarts: 1},
			map[string]float64{"connected": 0, "reconnects": 1, "notifications": 0, "garbled": 0, "ignored": 0, "missed": 1, "deaf": 0}},
		{"a leftover LISTEN", notify.Stats{Connected: true, Connects: 1, Notifications: 2, Ignored: 5},
			map[string]float64{"connected": 1, "reconnects": 0, "notifications": 2, "garbled": 0, "ignored": 5, "missed": 0, "deaf": 0}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &listenerCollector{stats: func() notify.Stats { return tc.stats }}
			ch := make(chan prometheus.Metric, 16)
			c.Collect(ch)
			close(ch)
			got := map[string]float64{}
			for m := range ch {
				var pb dto.Metric
				if err := m.Write(&pb); err != nil {
					t.Fatal(err)
				}
				v := pb.GetGauge().GetValue()
				if pb.Counter != nil {
					v = pb.GetCounter().GetValue()
				}
				got[names[m.Desc()]] = v
			}
			if !maps.Equal(got, tc.want) {
				t.Errorf("collected %v, want %v", got, tc.want)
			}
		})
	}
}

// TestDepthsOncePerQueue: two rows of the queue list for one queue (two
// consumers on it, one moved there by SQL) give one set of its series. The
// collector sent both, and the registry failed the whole gather: "was
// collected before with the same name and label values".
func TestDepthsOncePerQueue(t *testing.T) {
	reg := prometheus.NewRegistry()
	New(context.Background(), reg, zerolog.Nop(), func() notify.Stats { return notify.Stats{} },
		func(context.Context) ([]bellhop.QueueInfo, error) {
			a, b, c := uuid.New(), uuid.New(), uuid.New()
			return []bellhop.QueueInfo{
				{App: "shop", Queue: "orders", Ready: 3, ConsumerID: &a},
				{App: "shop", Queue: "orders", Ready: 3, ConsumerID: &b},
				{App: "shop", Queue: "refunds", Ready: 1, ConsumerID: &c},
			}, nil
		})
	families, err := reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	series := map[string]int{}
	for _, f := range families {
		if f.GetName() != "bellhop_queue_messages" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "queue" {
					series[l.GetValue()]++
				}
			}
		}
	}
	if want := map[string]int{"orders": 4, "refunds": 4}; !maps.Equal(series, want) {
		t.Errorf("bellhop_queue_messages series per queue: %v, want %v", series, want)
	}
}

// TestReclaimedFromTheStart: bellhop_reclaimed_total has both its series,
// released and dead_lettered, at 0 before any reclaim. They appeared only
// with the first reclaim, so a scrape of a healthy daemon lacked a metric
// that the README lists.
func TestReclaimedFromTheStart(t *testing.T) {
	reg := prometheus.NewRegistry()
	New(context.Background(), reg, zerolog.Nop(), func() notify.Stats { return notify.Stats{} },
		func(context.Context) ([]bellhop.QueueInfo, error) { return nil, nil })
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, f := range families {
		if f.GetName() != "bellhop_reclaimed_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "result" {
					got[l.GetValue()] = m.GetCounter().GetValue()
				}
			}
		}
	}
	want := map[string]float64{"released": 0, "dead_lettered": 0}
	if !maps.Equal(got, want) {
		t.Errorf("bellhop_reclaimed_total before any reclaim: %v; want %v", got, want)
	}
}

// gather gathers reg and returns the series of the family name, each as
// its labels (name=value, sorted, comma-joined) mapped to its value.
func gather(t *testing.T, reg *prometheus.Registry, name string) map[string]float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	got := map[string]float64{}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetName()+"="+l.GetValue())
			}
			v := m.GetGauge().GetValue() + m.GetCounter().GetValue()
			got[strings.Join(labels, ",")] = v
		}
	}
	return got
}

// TestUnservedQueuesShareASeries: the depths of queues that no consumer
// serves are summed per app under one queue label. Producers name queues:
// one INSERT of 20,000 messages with distinct queue names made 100,001
// depth series, on every dispatcher.
func TestUnservedQueuesShareASeries(t *testing.T) {
	served := uuid.New()
	qs := []bellhop.QueueInfo{{App: "shop", Queue: "orders", Ready: 2, OldestReady: time.Second, ConsumerID: &served}}
	for i := range 1000 {
		qs = append(qs, bellhop.QueueInfo{App: "shop", Queue: fmt.Sprint("q", i), Ready: 1, Delayed: 2, Dead: 3, OldestReady: time.Duration(i) * time.Second})
	}
	qs = append(qs, bellhop.QueueInfo{App: "blog", Queue: "posts", InFlight: 4})
	reg := prometheus.NewRegistry()
	New(context.Background(), reg, zerolog.Nop(), func() notify.Stats { return notify.Stats{} },
		func(context.Context) ([]bellhop.QueueInfo, error) { return qs, nil })
	wantDepths := map[string]float64{
		"app=shop,queue=orders,state=ready": 2, "app=shop,queue=orders,state=delayed": 0,
		"app=shop,queue=orders,state=in_flight": 0, "app=shop,queue=orders,state=dead": 0,
		"app=shop,queue=(no consumer),state=ready": 1000, "app=shop,queue=(no consumer),state=delayed": 2000,
		"app=shop,queue=(no consumer),state=in_flight": 0, "app=shop,queue=(no consumer),state=dead": 3000,
		"app=blog,queue=(no consumer),state=ready": 0, "app=blog,queue=(no consumer),state=delayed": 0,
		"app=blog,queue=(no consumer),state=in_flight": 4, "app=blog,queue=(no consumer),state=dead": 0,
	}
	if got := gather(t, reg, "bellhop_queue_messages"); !maps.Equal(got, wantDepths) {
		t.Errorf("bellhop_queue_messages: %d series %v\nwant %v", len(got), got, wantDepths)
	}
	wantOldest := map[string]float64{"app=shop,queue=orders": 1, "app=shop,queue=(no consumer)": 999, "app=blog,queue=(no consumer)": 0}
	if got := gather(t, reg, "bellhop_queue_oldest_ready_seconds"); !maps.Equal(got, wantOldest) {
		t.Errorf("bellhop_queue_oldest_ready_seconds: %d series %v\nwant %v", len(got), got, wantOldest)
	}
	if err := validate.QueueName(NoConsumer); err == nil {
		t.Errorf("%q is a valid queue name: its series would mix with that queue's", NoConsumer)
	}
}

// TestOutcomesFromTheFirstDelivery: a queue's first delivery makes all its
// outcome series, at 0. Each appeared with its first use, at 1, which
// increase() does not count: an alert on a queue's first dead letter
// never fired.
func TestOutcomesFromTheFirstDelivery(t *testing.T) {
	reg := prometheus.NewRegistry()
	r := New(context.Background(), reg, zerolog.Nop(), func() notify.Stats { return notify.Stats{} },
		func(context.Context) ([]bellhop.QueueInfo, error) { return nil, nil })
	if got := gather(t, reg, "bellhop_settled_total"); len(got) != 0 {
		t.Errorf("bellhop_settled_total before any delivery: %v, want no series", got)
	}
	m := &bellhop.Message{App: "shop", Queue: "orders", EnqueuedAt: time.Now()}
	r.Delivered(m)
	r.Delivered(m)
	r.Settled(m, bellhop.Acked, time.Millisecond)
	want := map[string]float64{}
	for _, o := range []string{"acked", "nacked", "dead_lettered", "released", "lease_lost", "write_failed"} {
		want["app=shop,outcome="+o+",queue=orders"] = 0
	}
	want["app=shop,outcome=acked,queue=orders"] = 1
	if got := gather(t, reg, "bellhop_settled_total"); !maps.Equal(got, want) {
		t.Errorf("bellhop_settled_total after two deliveries and an ack: %v\nwant %v", got, want)
	}
}

// TestStatementErrors: bellhop_statement_errors_total has a series for
// each operation from the start, at 0, and counts what Failed reports.
// Failed claims were only logged.
func TestStatementErrors(t *testing.T) {
	reg := prometheus.NewRegistry()
	r := New(context.Background(), reg, zerolog.Nop(), func() notify.Stats { return notify.Stats{} },
		func(context.Context) ([]bellhop.QueueInfo, error) { return nil, nil })
	want := map[string]float64{"op=claim": 0, "op=poll": 0, "op=reclaim": 0, "op=reload": 0, "op=offer": 0}
	if got := gather(t, reg, "bellhop_statement_errors_total"); !maps.Equal(got, want) {
		t.Errorf("bellhop_statement_errors_total at the start: %v, want %v", got, want)
	}
	r.Failed(bellhop.OpClaim)
	r.Failed(bellhop.OpClaim)
	r.Failed(bellhop.OpReload)
	want["op=claim"], want["op=reload"] = 2, 1
	if got := gather(t, reg, "bellhop_statement_errors_total"); !maps.Equal(got, want) {
		t.Errorf("bellhop_statement_errors_total after two failed claims and a failed reload: %v, want %v", got, want)
	}
}
