package main

import (
	"context"
	"fmt"
	"runtime"
	"runtime/debug"
	"sync/atomic"
	"time"

	"github.com/bellhopq/bellhop"
)

func scaleCase(queues, r int) string {
	if queues == 1 {
		return fmt.Sprintf("1 queue, %s msgs/s", groupThousands(fmt.Sprint(r)))
	}
	return fmt.Sprintf("%s queues, %s msgs/s to random queues", groupThousands(fmt.Sprint(queues)), groupThousands(fmt.Sprint(r)))
}

// Scale metric names, used by the targets too.
const (
	mAchievedRate  = "achieved enqueue rate"
	mScaleP99Ratio = "p99 ratio"
)

// scaleRatioCase names the per-run comparison of the two scale cases.
func scaleRatioCase(p params) string {
	return fmt.Sprintf("%s queues ÷ 1 queue, same run", groupThousands(fmt.Sprint(p.scaleQueues)))
}

// runScale: many queues, each with a consumer, and a producer sending to
// random ones; latency and the dispatcher's memory.
func runScale(ctx context.Context, e *env, run int) error {
	// The one-queue reference runs right next to the many-queue case,
	// under the same conditions, so the two compare on a shared, noisy
	// machine; the target takes the ratio of each such pair, as the River
	// scenario's back-to-back pairs do. Which goes first alternates, so
	// that a drift within the pair (what the first case leaves behind,
	// autovacuum) does not always fall on the same side.
	p99 := map[int]float64{}
	for _, queues := range inRunOrder(run, []int{1, e.p.scaleQueues}) {
		st, err := scaleOnce(ctx, e, run, queues)
		if err != nil {
			return fmt.Errorf("%s: %w", scaleCase(queues, e.p.scaleRate), err)
		}
		p99[queues] = st.P99
	}
	addScaleRatio(e.res, e.p, p99[1], p99[e.p.scaleQueues])
	e.res.Note("scale", "'%s': each run's p99 with %s queues over its own p99 with 1 queue, measured right before it in odd runs and right after it in even ones; the target takes the median of these per-run ratios, and fails if in any run either case reached less than 95%% of %s msgs/s",
		scaleRatioCase(e.p), groupThousands(fmt.Sprint(e.p.scaleQueues)), groupThousands(fmt.Sprint(e.p.scaleRate)))
	return nil
}

// addScaleRatio records a run's p99 with many queues over its p99 with
// one.
func addScaleRatio(r *Results, p params, one, many float64) {
	r.Add(Metric{Scenario: "scale", Case: scaleRatioCase(p), Name: mScaleP99Ratio, Unit: "×", LowerIsBetter: true}, many/one)
}

// scaleOnce measures the scale case with queues queues and returns its
// latencies.
func scaleOnce(ctx context.Context, e *env, run, queues int) (latencyStats, error) {
	db, err := e.srv.newDatabase(ctx, "scale", true)
	if err != nil {
		return latencyStats{}, err
	}
	defer db.drop()
	cas := scaleCase(queues, e.p.scaleRate)
	n := int(float64(e.p.scaleRate) * e.p.scaleDuration.Seconds())
	rec := newRecorder(e.base, n)

	var baseline, end int64
	var peak atomic.Int64
	var settle time.Duration
	var settleKnown bool
	sctx, stopSampling := context.WithCancel(ctx)
	defer stopSampling()
	sampled := make(chan struct{})
	sample := func() {
		if v, err := vmRSS(); err == nil && v > peak.Load() {
			peak.Store(v)
		}
	}
	var stopProfile func()
	// A run that fails after beforeStart started the profiler must stop
	// it too: the next StartCPUProfile would fail ("cpu profiling already
	// in use").
	defer func() {
		if stopProfile != nil {
			stopProfile()
		}
	}()
	var ms runtime.MemStats
	var goroutines int
	delivered := func() {
		goroutines = runtime.NumGoroutine()
		runtime.ReadMemStats(&ms)
		if stopProfile != nil {
			stopProfile()
			stopProfile = nil
		}
		stopSampling()
		<-sampled
		end, _ = vmRSS()
		sample()
	}
	h := &hooks{
		// The producers stop at the end of the period whether or not
		// they kept up, as in the load scenario: the rate check of the
		// target then sees the shortfall as a rate, and a run that fell
		// behind does not go on for minutes.
		duration: e.p.scaleDuration,
		warmup:   warmupFor(e.p.scaleDuration),
		vacuum:   true,
		beforeStart: func() error {
			// Everything but the dispatcher exists now: the consumers
			// are registered, the producers' pool is open and the
			// latency arrays are allocated.
			runtime.GC()
			debug.FreeOSMemory()
			var err error
			if baseline, err = vmRSS(); err != nil {
				return err
			}
			// Both cases of the evidence run are profiled, so that its
			// ratio compares like with like, as the scored runs' do.
			if e.cpuprofile != "" && e.evidenceRun(run) {
				if stopProfile, err = e.startProfile(fmt.Sprintf("scale-q%d", queues)); err != nil {
					return err
				}
			}
			go func() {
				defer close(sampled)
				t := time.NewTicker(250 * time.Millisecond)
				defer t.Stop()
				for {
					sample()
					select {
					case <-sctx.Done():
						return
					case <-t.C:
					}
				}
			}()
			return nil
		},
		settled:   func(d time.Duration, known bool) { settle, settleKnown = d, known },
		delivered: delivered,
	}
	if e.evidenceRun(run) {
		h.sampleWaits = "scale: " + cas + " (evidence run), all sessions"
		if db.s.pss {
			w := &stmtWindow{e: e, db: db, scenario: "scale", label: "scale: " + cas + " (evidence run), while producing", top: 8}
			settled := h.settled
			h.settled = func(d time.Duration, known bool) { settled(d, known); w.open(ctx) }
			h.delivered = func() {
				delivered()
				w.close(ctx)
			}
		}
	}
	st, achieved, err := latencyRunRate(ctx, e, db, reportAs{"scale", cas}, run, queueNames(queues), bellhop.ConsumerSpec{}, every(rec.handler()), rec,
		time.Second/time.Duration(e.p.scaleRate), producersFor(e.p.scaleRate), h)
	if err != nil {
		return st, err
	}
	if stopProfile != nil {
		stopProfile()
		stopProfile = nil
	}
	if err := rec.dump(e, "scale", cas, run); err != nil {
		return st, err
	}
	const mib = 1 << 20
	addLatency(e.res, "scale", cas, st, true)
	addLatency(e.res, "scale", cas+caseFromDue, rec.fromDue(), true)
	e.res.Add(Metric{Scenario: "scale", Case: cas, Name: mAchievedRate, Unit: "msgs/s"}, achieved)
	e.res.Add(Metric{Scenario: "scale", Case: cas, Name: "dispatcher RSS (peak VmRSS − baseline)", Unit: "MiB", LowerIsBetter: true}, float64(peak.Load()-baseline)/mib)
	e.res.Add(Metric{Scenario: "scale", Case: cas, Name: "dispatcher RSS (VmRSS at end − baseline)", Unit: "MiB", LowerIsBetter: true}, float64(end-baseline)/mib)
	e.res.Add(Metric{Scenario: "scale", Case: cas, Name: "goroutines at end (whole process)", Unit: "goroutines", LowerIsBetter: true}, float64(goroutines))
	e.res.Add(Metric{Scenario: "scale", Case: cas, Name: "Go stacks in use at end (whole process)", Unit: "MiB", LowerIsBetter: true}, float64(ms.StackInuse)/mib)
	e.res.Add(Metric{Scenario: "scale", Case: cas, Name: "Go heap in use at end (whole process)", Unit: "MiB", LowerIsBetter: true}, float64(ms.HeapInuse)/mib)
	addSettled(e.res, Metric{Scenario: "scale", Case: cas, Name: "start-up: ready → claims settled", Unit: "s", LowerIsBetter: true}, settle, settleKnown, db.s.pss, run, settleMaxFor(queues))
	e.res.Note("scale", "%d queues (and, right next to it in each run, the same with 1 queue, as the reference: before it in odd runs, after it in even ones, since 2026-12-07), one consumer each (defaults), one no-op Go handler through a Resolver; once the consumers are registered, VACUUM ANALYZE of the database and CHECKPOINT (since 2026-12-07), then the dispatcher starts; after the start-up claims settle, %s at %d msgs/s, each to a random queue, one Client.Enqueue per message from %d producer goroutines (who stop at the end of the period whether or not they kept up), after a warm-up of %s at the same rate, delivered but not measured (since 2026-11-30: the pools open their connections lazily, and new server sessions are slow at first); latency as in the latency scenario, and '…%s' as in the load scenario; unix socket",
		e.p.scaleQueues, e.p.scaleDuration, e.p.scaleRate, producersFor(e.p.scaleRate), warmupFor(e.p.scaleDuration), caseFromDue)
	e.res.Note("scale", "'%s': messages sent divided by the time from the first scheduled send to the return of the last Enqueue", mAchievedRate)
	e.res.Note("scale", "RSS: the dispatcher runs in this process; VmRSS from /proc/self/status sampled every 250ms from just before Dispatcher.Run (start-up claims included) to the last delivery, minus a baseline taken just before Dispatcher.Run (after GC and FreeOSMemory; consumers registered, producer pool open, latency arrays allocated); so it includes the latency payloads in flight and Go heap not yet returned to the OS")
	return st, nil
}
