package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/bellhopq/bellhop"
)

// loadCase names a producer rate and the consumer's max in-flight (0:
// the default).
func loadCase(rate, inFlight int) string {
	s := groupThousands(fmt.Sprint(rate)) + " msgs/s offered"
	if inFlight != 0 {
		s += ", in-flight " + groupThousands(fmt.Sprint(inFlight))
	}
	return s
}

// loadRun is one configuration of the load scenario.
type loadRun struct{ rate, inFlight int }

// loadCases are the load scenario's configurations: each of p's rates,
// then the highest again with a wider consumer window (with the default
// of 10 a lane claims a few messages per round trip, which may be what
// limits it rather than the rate).
func loadCases(p params) []loadRun {
	if len(p.loadRates) == 0 {
		return nil
	}
	var cases []loadRun
	for _, r := range p.loadRates {
		cases = append(cases, loadRun{rate: r})
	}
	return append(cases, loadRun{rate: slices.Max(p.loadRates), inFlight: 1000})
}

// caseFromDue suffixes the case of a rate-driven scenario (load, scale)
// whose latencies run from each message's due time by the producers'
// schedule rather than from its send: when the producers fall behind, a
// message goes out late, and latency from the send leaves that wait out
// (coordinated omission), so the case's own percentiles understate what
// a message offered at that rate waits.
const caseFromDue = ": from due time"

// producersFor is how many producer goroutines (and connections) a rate
// gets: enough that commits waiting for their WAL flush do not hold the
// schedule back.
func producersFor(rate int) int { return min(max(rate/100, 4), 64) }

// runLoad: producers at a fixed rate for a while, latency measured as in
// the latency scenario.
func runLoad(ctx context.Context, e *env, run int) error {
	for _, c := range loadCases(e.p) {
		if _, err := loadOnce(ctx, e, c, run); err != nil {
			return fmt.Errorf("%s: %w", loadCase(c.rate, c.inFlight), err)
		}
	}
	e.res.Note("load", "'delivered while producing': handlers started per second from the first Enqueue to the return of the last; below 'achieved' means a backlog built up (and latency grew) while the producers ran")
	e.res.Note("load", "one queue, consumer defaults (max in-flight %d) except the case marked in-flight 1,000, Go no-op handler; %s per rate, after a warm-up of %s at the same rate from the same producers, delivered but not measured (as in the scale scenario: the pools open their connections lazily, and new server sessions are slow at first); message i is due at start + i/rate and sent by the next free producer goroutine (%d goroutines and connections at 1,000/s, %d at 5,000/s), one Client.Enqueue (one transaction) each; latency from just before Enqueue to the handler's start; unix socket",
		bellhop.DefaultMaxInFlight, e.p.loadDuration, warmupFor(e.p.loadDuration), producersFor(1000), producersFor(5000))
	e.res.Note("load", "producers stop at the end of the %s whether or not they kept up; 'achieved' is messages sent divided by the time from the first scheduled send to the return of the last Enqueue; below the offered rate means the producers could not keep up; latencies are of the messages sent (messages never sent are in no figure); a run below %.0f%% of its offered rate is named in a warning here (since 2026-12-07)", e.p.loadDuration, 100*minOfferedShare)
	e.res.Note("load", "'…%s' (since 2026-12-07): the same messages, timed from when each was due by the schedule (start + i/rate) to its handler's start; it differs from the case's own figures by how late the producers sent, which latency from just before Enqueue leaves out", caseFromDue)
	return nil
}

// loadOnce measures one load case and returns its recorder.
func loadOnce(ctx context.Context, e *env, c loadRun, run int) (*recorder, error) {
	r, cas := c.rate, loadCase(c.rate, c.inFlight)
	db, err := e.srv.newDatabase(ctx, "load", true)
	if err != nil {
		return nil, err
	}
	defer db.drop()
	n := int(float64(r) * e.p.loadDuration.Seconds())
	rec := newRecorder(e.base, n)
	h := &hooks{duration: e.p.loadDuration, warmup: warmupFor(e.p.loadDuration)}
	if e.evidenceRun(run) {
		h.sampleWaits = "load: " + cas + " (evidence run), all sessions"
		if db.s.pss {
			w := &stmtWindow{e: e, db: db, scenario: "load", label: "load: " + cas + " (evidence run), while producing", top: 6}
			h.settled = func(time.Duration, bool) { w.open(ctx) }
			h.delivered = func() { w.close(ctx) }
		}
	}
	st, achieved, err := latencyRunRate(ctx, e, db, reportAs{"load", cas}, run, []string{"load"}, bellhop.ConsumerSpec{MaxInFlight: c.inFlight}, every(rec.handler()), rec,
		time.Second/time.Duration(r), producersFor(r), h)
	if err != nil {
		return nil, err
	}
	if e.timeline {
		fmt.Fprintf(e.progress, "timeline of %s, run %d (second since the first send: Enqueue calls returned, handlers started):\n", cas, run)
		printTimeline(e.progress, rec)
	}
	addLatency(e.res, "load", cas, st, true)
	addLatency(e.res, "load", cas+caseFromDue, rec.fromDue(), true)
	e.res.Add(Metric{Scenario: "load", Case: cas, Name: mAchievedRate, Unit: "msgs/s"}, achieved)
	e.res.Add(Metric{Scenario: "load", Case: cas, Name: "delivered while producing", Unit: "msgs/s"}, rec.deliveredBy(time.Duration(achievedWindow(rec))))
	return rec, nil
}

// printTimeline prints, per second since the first send (the earliest
// Enqueue call to begin), how many Enqueue calls returned and how many
// handlers started (a debugging aid).
func printTimeline(w io.Writer, rec *recorder) {
	first, ok := rec.firstSend()
	if !ok {
		return
	}
	var enq, del []int
	bump := func(xs []int, t int64) []int {
		if t <= 0 {
			return xs
		}
		i := int(max(t-first, 0) / int64(time.Second))
		for len(xs) <= i {
			xs = append(xs, 0)
		}
		xs[i]++
		return xs
	}
	for i := range rec.lat {
		if rec.seen[i].Load() {
			enq = bump(enq, rec.returned[i])
			del = bump(del, rec.started[i])
		}
	}
	for i := range max(len(enq), len(del)) {
		var a, b int
		if i < len(enq) {
			a = enq[i]
		}
		if i < len(del) {
			b = del[i]
		}
		if a+b > 0 {
			fmt.Fprintf(w, "  t=%ds enqueued %d delivered %d\n", i, a, b)
		}
	}
}

// achievedWindow is the time (since the recorder's base) at which the
// last Enqueue call returned.
func achievedWindow(rec *recorder) int64 {
	var last int64
	for i := range rec.lat {
		if rec.seen[i].Load() && rec.returned[i] > last {
			last = rec.returned[i]
		}
	}
	return last
}
