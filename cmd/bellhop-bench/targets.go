package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"strings"
)

// Target is one of the performance targets, evaluated on medians.
type Target struct {
	Name   string  `json:"name"`
	Rule   string  `json:"rule"`
	Value  float64 `json:"value"`
	Limit  float64 `json:"limit"`
	Unit   string  `json:"unit"`
	Pass   bool    `json:"pass"`
	Known  bool    `json:"known"` // false: a figure it needs was not measured
	Detail string  `json:"detail"`
}

// MarshalJSON writes a value or limit that was not measured (NaN) as
// null: JSON has no NaN, and a run of some scenarios (-only) leaves the
// others' targets unknown.
func (t Target) MarshalJSON() ([]byte, error) {
	type plain Target
	finite := func(v float64) *float64 {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return nil
		}
		return &v
	}
	return json.Marshal(struct {
		plain
		Value *float64 `json:"value"`
		Limit *float64 `json:"limit"`
	}{plain(t), finite(t.Value), finite(t.Limit)})
}

// Verdict is PASS, FAIL, or n/a when a figure t needs is missing.
func (t Target) Verdict() string {
	switch {
	case !t.Known:
		return "n/a"
	case t.Pass:
		return "PASS"
	}
	return "FAIL"
}

// evaluateTargets checks the targets against the medians in r.
func evaluateTargets(r *Results, p params) []Target {
	get := func(sc, cas, name string) float64 {
		v, ok := r.Get(sc, cas, name)
		if !ok {
			return math.NaN()
		}
		return v
	}
	var out []Target
	add := func(name, rule, unit string, value, limit float64, atMost bool, detail string) {
		t := Target{Name: name, Rule: rule, Value: value, Limit: limit, Unit: unit, Detail: detail}
		t.Known = !math.IsNaN(value) && !math.IsNaN(limit)
		if t.Known {
			if atMost {
				t.Pass = value <= limit
			} else {
				t.Pass = value >= limit
			}
		}
		out = append(out, t)
	}

	p50 := get("latency", caseGo, "p50")
	p99 := get("latency", caseGo, "p99")
	insNotify := get("floor", caseFloorInsertNotify, "p50")
	sel := get("floor", "SELECT 1 round trip (unix socket)", "p50")
	add("latency p50 vs physical floor", "Bellhop p50 ≤ 1.3 × (INSERT + NOTIFY round trip p50 + SELECT 1 p50, unix socket)", "µs",
		p50, 1.3*(insNotify+sel), true, fmt.Sprintf("INSERT + NOTIFY %s µs + SELECT 1 %s µs", num(insNotify), num(sel)))
	add("latency p99", "Bellhop p99 ≤ 2 ms", "µs", p99, 2000, true, "Go handler, 10 ms apart")
	fetch2 := riverFetches[1]
	riverP50 := get("river", riverLatencyCase(fetch2), "p50")
	add("latency p50 vs River", "Bellhop p50 ≤ 0.75 × "+fetch2.ruleName()+" p50", "µs", p50, 0.75*riverP50, true,
		fmt.Sprintf("River p50 %s µs", num(riverP50)))

	// The same three with DispatcherConfig.LeaseAtInsert, when measured.
	if lp50, lp99 := get("latency", caseGoLease, "p50"), get("latency", caseGoLease, "p99"); !math.IsNaN(lp50) {
		add("latency p50 vs physical floor, leasing at INSERT", "as above, with DispatcherConfig.LeaseAtInsert", "µs",
			lp50, 1.3*(insNotify+sel), true, fmt.Sprintf("INSERT + NOTIFY %s µs + SELECT 1 %s µs", num(insNotify), num(sel)))
		add("latency p99, leasing at INSERT", "as above, with DispatcherConfig.LeaseAtInsert", "µs", lp99, 2000, true, "Go handler, 10 ms apart")
		add("latency p50 vs River, leasing at INSERT", "as above, with DispatcherConfig.LeaseAtInsert", "µs", lp50, 0.75*riverP50, true,
			fmt.Sprintf("River p50 %s µs", num(riverP50)))
	}

	// The same comparisons with each ratio taken from a pair measured back
	// to back in the River scenario: the median of the per-run ratios.
	if lr := get("river", backToBackCase(fetch2), mLatencyRatio); !math.IsNaN(lr) {
		add("latency p50 vs River, back to back", "median of per-run (Bellhop p50 ÷ "+fetch2.ruleName()+" p50), each pair measured back to back", "×", lr, 0.75, true,
			"per run "+perRun(r, "river", backToBackCase(fetch2), mLatencyRatio)+leftOut(r, "river"))
	}
	if lr := get("river", backToBackCase(fetch2), mLatencyRatioLease); !math.IsNaN(lr) {
		add("latency p50 vs River, leasing at INSERT, back to back", "as above, with DispatcherConfig.LeaseAtInsert, measured beside the same River case", "×", lr, 0.75, true,
			"per run "+perRun(r, "river", backToBackCase(fetch2), mLatencyRatioLease)+leftOut(r, "river"))
	}

	small := 0
	if len(p.throughputSizes) > 0 {
		small = p.throughputSizes[0]
	}
	for _, c := range burnDownPairs {
		bh := get("throughput", throughputCase{N: small, Queues: 1, InFlight: c.inFlight}.String(), mToEmpty)
		rv := get("river", riverBurndownCase(fetch2, p.riverBurndownN, c.workers), mRiverJobs)
		add(fmt.Sprintf("burn-down, in-flight %s", groupThousands(fmt.Sprint(c.inFlight))),
			fmt.Sprintf("Bellhop %s msgs, 1 queue, in-flight %d ≥ %.1f × %s", groupThousands(fmt.Sprint(small)), c.inFlight, c.factor,
				fetch2.ruleName(groupThousands(fmt.Sprint(c.workers))+" workers", groupThousands(fmt.Sprint(p.riverBurndownN))+" jobs")),
			"msgs/s", bh, c.factor*rv, false, fmt.Sprintf("start → table empty vs River's start → completed in DB; River %s jobs/s", num(rv)))
	}
	for _, c := range burnDownPairs {
		name := burnDownRatio(c.inFlight, c.workers)
		if br := get("river", backToBackCase(fetch2), name); !math.IsNaN(br) {
			add(fmt.Sprintf("burn-down, in-flight %s, back to back", groupThousands(fmt.Sprint(c.inFlight))),
				fmt.Sprintf("median of per-run (Bellhop %s msgs, 1 queue, in-flight %d ÷ %s) ≥ %.1f, each pair measured back to back", groupThousands(fmt.Sprint(p.riverBurndownN)), c.inFlight,
					fetch2.ruleName(groupThousands(fmt.Sprint(c.workers))+" workers"), c.factor),
				"×", br, c.factor, false, "per run "+perRun(r, "river", backToBackCase(fetch2), name)+leftOut(r, "river"))
		}
	}

	idle := get("idle", idleCase(p), mIdleStatements)
	add("idle load", "≤ 2 statements/min with 1,000 consumers", "stmts/min", idle, 2, true, "pg_stat_statements, this database")

	// Each run's ratio comes from a pair measured one right after the
	// other (runScale): a ratio of the two cases' medians could set one
	// run's 10,000 queues against another run's single queue.
	ratio := get("scale", scaleRatioCase(p), mScaleP99Ratio)
	manyP99 := get("scale", scaleCase(p.scaleQueues, p.scaleRate), "p99")
	add("latency p99, 10k queues vs 1 queue",
		fmt.Sprintf("median of per-run (p99 with %s queues ÷ p99 with 1 queue) ≤ 2, each pair from the same run, both at %s msgs/s", groupThousands(fmt.Sprint(p.scaleQueues)), groupThousands(fmt.Sprint(p.scaleRate))), "×",
		ratio, 2, true, "per run "+perRun(r, "scale", scaleRatioCase(p), mScaleP99Ratio)+leftOut(r, "scale")+
			fmt.Sprintf("; p99 medians: 1 queue %s µs, %s queues %s µs", num(get("scale", scaleCase(1, p.scaleRate), "p99")),
				groupThousands(fmt.Sprint(p.scaleQueues)), num(manyP99))+idleP99Ratio(manyP99, get("latency", caseGo, "p99")))
	// Both cases of a run must have had the load the rule names:
	// producers that fall behind send fewer messages, and a latency
	// measured from each send leaves their lag out, so a run in which
	// either case was driven at less than 95% of the rate is not the case
	// the rule compares, whatever its ratio.
	if t := &out[len(out)-1]; t.Known {
		for _, x := range r.RunValues("scale", scaleRatioCase(p), mScaleP99Ratio) {
			for _, q := range []int{1, p.scaleQueues} {
				got := valueOfRun(r, "scale", scaleCase(q, p.scaleRate), mAchievedRate, x.Run)
				if !(got >= minOfferedShare*float64(p.scaleRate)) {
					t.Pass = false
					t.Detail += fmt.Sprintf("; FAIL as run: in run %d the %s-queue case reached %s of %s msgs/s", x.Run, groupThousands(fmt.Sprint(q)), num(got), groupThousands(fmt.Sprint(p.scaleRate)))
				}
			}
		}
	}
	rss := get("scale", scaleCase(p.scaleQueues, p.scaleRate), "dispatcher RSS (peak VmRSS − baseline)")
	add("dispatcher RSS, 10k queues", "peak RSS − baseline < 200 MiB", "MiB", rss, 200, true, "in-process dispatcher")

	// Issue 7 (busy marks): only when the busy scenario ran.
	const busyMetric = "enqueues/s (1 msg per transaction)"
	marked := get("busy", "32 producers, dispatcher draining, trigger on, busy marks", busyMetric)
	off := get("busy", "32 producers, dispatcher draining, trigger off", busyMetric)
	if !math.IsNaN(marked) || !math.IsNaN(off) {
		add("producers with busy marks", "32 producers, dispatcher draining: trigger on with busy marks ≥ 0.9 × trigger off", "msgs/s",
			marked, 0.9*off, false, fmt.Sprintf("trigger off %s msgs/s", num(off)))
	}
	return out
}

// minOfferedShare is the share of its offered rate that a case driven at
// a fixed rate (load, scale) must reach to count as measured at that
// rate: producers that fall behind send fewer messages, later than due,
// and the latency of those they send is that of a lighter load.
const minOfferedShare = 0.95

// valueOfRun returns the value of the metric that run recorded, or NaN.
func valueOfRun(r *Results, scenario, cas, name string, run int) float64 {
	for _, y := range r.RunValues(scenario, cas, name) {
		if y.Run == run {
			return y.V
		}
	}
	return math.NaN()
}

// idleP99Ratio is, for the scale target's detail, the 10,000-queue p99
// median over the idle latency scenario's: not a pair measured side by
// side (the two scenarios run minutes apart, at 1,000 msgs/s and at one
// message every 10 ms), so no target reads it; "" unless both are known.
func idleP99Ratio(manyP99, idleP99 float64) string {
	if math.IsNaN(manyP99) || math.IsNaN(idleP99) || idleP99 == 0 {
		return ""
	}
	return fmt.Sprintf("; against the latency scenario's %s p99 median (%s µs; another scenario, not a pair): %.1f ×", caseGo, num(idleP99), manyP99/idleP99)
}

// loadRateWarnings names each scored run of a load case whose producers
// reached less than minOfferedShare of the offered rate: its latencies
// are those of a lighter load than the case names. The load scenario has
// no target, so these go to its notes, as the scale target's detail names
// such runs.
func loadRateWarnings(r *Results, p params) []string {
	var out []string
	for _, c := range loadCases(p) {
		cas := loadCase(c.rate, c.inFlight)
		for _, x := range r.RunValues("load", cas, mAchievedRate) {
			if x.V < minOfferedShare*float64(c.rate) {
				out = append(out, fmt.Sprintf("warning: '%s', run %d: the producers reached %s of %s msgs/s (%.0f%%), below %.0f%% of the offered rate: its latencies are of a lighter load ('%s%s' counts how late they sent)",
					cas, x.Run, num(x.V), groupThousands(fmt.Sprint(c.rate)), 100*x.V/float64(c.rate), 100*minOfferedShare, cas, caseFromDue))
			}
		}
	}
	return out
}

func idleCase(p params) string {
	return fmt.Sprintf("%s consumers, %s", groupThousands(fmt.Sprint(p.idleConsumers)), p.idleDuration)
}

func writeTargets(w io.Writer, ts []Target, markdown bool) {
	if markdown {
		fmt.Fprintln(w, "| Target | Rule | Bellhop | Limit | Result | Detail |")
		fmt.Fprintln(w, "|---|---|--:|--:|---|---|")
		for _, t := range ts {
			fmt.Fprintf(w, "| %s | %s | %s %s | %s %s | **%s** | %s |\n", t.Name, mdEscape(t.Rule), num(t.Value), t.Unit, num(t.Limit), t.Unit, t.Verdict(), mdEscape(t.Detail))
		}
		return
	}
	for _, t := range ts {
		fmt.Fprintf(w, "  %-4s  %-38s %s %s vs limit %s %s  (%s; %s)\n", t.Verdict(), t.Name, num(t.Value), t.Unit, num(t.Limit), t.Unit, t.Rule, t.Detail)
	}
}

// perRun lists a metric's values in run order with their runs, for a
// target's detail: "r1 1.62, r3 1.90". Runs that failed are not among
// them (leftOut says so).
func perRun(r *Results, scenario, cas, name string) string {
	var out []string
	for _, x := range r.RunValues(scenario, cas, name) {
		out = append(out, fmt.Sprintf("r%d %.2f", x.Run, x.V))
	}
	return strings.Join(out, ", ")
}

// leftOut tells, for a target's detail, which runs of scenario failed and
// so are not in its figures.
func leftOut(r *Results, scenario string) string {
	runs := r.FailedRuns(scenario)
	if len(runs) == 0 {
		return ""
	}
	var s []string
	for _, n := range runs {
		s = append(s, fmt.Sprint(n))
	}
	return fmt.Sprintf("; %s run %s left out: failed (ERRORS)", scenario, strings.Join(s, ", "))
}
