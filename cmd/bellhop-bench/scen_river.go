package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/bellhopq/bellhop"
)

// riverFetch is a River fetch configuration.
type riverFetch struct {
	Name string
	// Settings spell out what Name abbreviates, for the targets' rules
	// and the notes: a rule that named only the cooldown hid that the
	// poll interval was changed too.
	Settings string
	Args     []string
	// BackToBack measures Bellhop's matching case right next to each of
	// this configuration's, for the targets' rules.
	BackToBack bool
	// Informational: no target reads this configuration's figures. Only
	// its latency is measured, no burn-down (to keep the scenario
	// short); with BackToBack, only Bellhop's default path is measured
	// beside it (not leasing at INSERT too), and the ratio is reported
	// as mLatencyRatioInfo, not mLatencyRatio.
	Informational bool
}

// riverFetches are River's configurations, in the order they run. The
// targets' rules read the second (riverFetches[1]); the informational
// ones come after it.
var riverFetches = []riverFetch{
	{Name: "River defaults", Settings: "FetchCooldown and FetchPollInterval at River's defaults"},
	{Name: "River 2ms/20ms", Settings: "FetchCooldown 2 ms, FetchPollInterval 20 ms", Args: []string{"-fetch-cooldown", "2ms", "-fetch-poll-interval", "20ms"}, BackToBack: true},
	// River's fetches and completions without waiting for the WAL
	// flush, as Bellhop's claims, acks and nacks commit; its inserts,
	// like Bellhop's producer's, still wait for it.
	{Name: "River 2ms/20ms, synchronous_commit off",
		Settings: "FetchCooldown 2 ms, FetchPollInterval 20 ms, synchronous_commit off on the River client's pool (fetches, completions, maintenance), the jobs inserted on a second pool at the server's setting (on); latency only, no burn-down; informational, in no target",
		Args:     []string{"-fetch-cooldown", "2ms", "-fetch-poll-interval", "20ms", "-client-synchronous-commit", "off"}, BackToBack: true, Informational: true},
}

// arg is the value that f passes to bench/river's flag name, or "".
func (f riverFetch) arg(name string) string {
	if i := slices.Index(f.Args, name); i >= 0 && i+1 < len(f.Args) {
		return f.Args[i+1]
	}
	return ""
}

// latencyRatio names the metric of f's back-to-back latency ratio.
func (f riverFetch) latencyRatio() string {
	if f.Informational {
		return mLatencyRatioInfo
	}
	return mLatencyRatio
}

// ruleName names f in a target's rule, with its settings and, if any,
// more of River's (workers, jobs).
func (f riverFetch) ruleName(more ...string) string {
	return "River (" + strings.Join(append([]string{f.Settings}, more...), "; ") + ")"
}

// burnDownPair is one of the burn-down comparisons: Bellhop at a
// max in-flight against River with a number of workers, and the factor by
// which Bellhop must be faster.
type burnDownPair struct {
	inFlight, workers int
	factor            float64
}

var burnDownPairs = []burnDownPair{{10, 10, 2}, {1000, 2000, 1.5}}

// Back-to-back cases and ratio names, used by the targets too.
func backToBackCase(f riverFetch) string { return "back to back: Bellhop ÷ " + f.Name }

const (
	mLatencyRatio      = "latency p50 ratio"
	mLatencyRatioLease = "latency p50 ratio, leasing at INSERT"
	// mLatencyRatioInfo is the ratio of an Informational configuration,
	// which no target reads.
	mLatencyRatioInfo = "latency p50 ratio (informational, no target)"
)

func burnDownRatio(inFlight, workers int) string {
	return fmt.Sprintf("burn-down ratio, in-flight %s ÷ %s workers", groupThousands(fmt.Sprint(inFlight)), groupThousands(fmt.Sprint(workers)))
}

// backToBack runs ours, Bellhop's case labelled label, and theirs one
// right after the other: ours first in odd runs, theirs first in even
// ones, so that neither always meets the state the other leaves behind.
func backToBack(run int, label string, ours, theirs func() error) error {
	a := func() error {
		if err := ours(); err != nil {
			return fmt.Errorf("%s: %w", label, err)
		}
		return nil
	}
	b := theirs
	if run%2 == 0 {
		a, b = b, a
	}
	if err := a(); err != nil {
		return err
	}
	return b()
}

// River case names, used by the targets too.
func riverLatencyCase(f riverFetch) string { return f.Name + ", latency" }
func riverBurndownCase(f riverFetch, n, workers int) string {
	return fmt.Sprintf("%s, burn-down %s, %s workers", f.Name, groupThousands(fmt.Sprint(n)), groupThousands(fmt.Sprint(workers)))
}

// River metric names.
const (
	mRiverJobs   = "jobs/s, start → completed in DB"
	mRiverWorked = "jobs/s, start → last Work returned"
	// The two parts of a River latency, as Bellhop's are split.
	mRiverInsertCall  = "Insert call"
	mRiverAfterInsert = "Insert returned → Work"
)

// buildRiver builds bench/river (a separate module) into dir.
func buildRiver(ctx context.Context, riverDir, dir string) (string, error) {
	out := filepath.Join(dir, "riverbench")
	cmd := exec.CommandContext(ctx, "go", "build", "-C", riverDir, "-o", out, ".")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("go build -C %s: %v: %s", riverDir, err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}

// runRiver runs River's latency and burn-down benchmarks against the
// same server, a fresh database each time. For a BackToBack
// configuration it measures Bellhop's matching case right next to each,
// and records the ratio of the two: the shared machine's speed drifts
// over minutes, and the targets' ratios should not compare figures taken
// ten minutes apart.
func runRiver(ctx context.Context, e *env, run int) error {
	if e.riverBin == "" {
		return fmt.Errorf("no River benchmark binary")
	}
	for _, f := range riverFetches {
		var res struct {
			// N is how many jobs River's figures are of: addLatency
			// records only a summary of some.
			N                 int     `json:"n"`
			P50US             float64 `json:"p50_us"`
			P90US             float64 `json:"p90_us"`
			P99US             float64 `json:"p99_us"`
			MaxUS             float64 `json:"max_us"`
			RiverVersion      string  `json:"river_version"`
			PoolMaxConns      int     `json:"pool_max_conns"`
			FetchCooldown     string  `json:"fetch_cooldown"`
			FetchPollInterval string  `json:"fetch_poll_interval"`
			// Set only with -client-synchronous-commit: SHOW
			// synchronous_commit on the client's and the insert pool.
			ClientSynchronousCommit string `json:"client_synchronous_commit"`
			InsertSynchronousCommit string `json:"insert_synchronous_commit"`
			InsertCall              struct {
				P50US float64 `json:"p50_us"`
				P99US float64 `json:"p99_us"`
			} `json:"insert_call"`
			AfterInsert struct {
				P50US float64 `json:"p50_us"`
				P99US float64 `json:"p99_us"`
			} `json:"insert_returned_to_work"`
		}
		theirs := func() error {
			args := append([]string{"-scenario", "latency", "-n", strconv.Itoa(e.p.riverLatencyN), "-interval", e.p.latencyInterval.String()}, f.Args...)
			if err := e.river(ctx, args, &res); err != nil {
				return fmt.Errorf("%s: %w", riverLatencyCase(f), err)
			}
			if want := f.arg("-client-synchronous-commit"); res.ClientSynchronousCommit != want {
				return fmt.Errorf("%s: bench/river reports synchronous_commit %q on the client's pool, want %q", riverLatencyCase(f), res.ClientSynchronousCommit, want)
			}
			addLatency(e.res, "river", riverLatencyCase(f), latencyStats{N: res.N, P50: res.P50US, P90: res.P90US, P99: res.P99US, Max: res.MaxUS}, true)
			addLatency(e.res, "river", riverLatencyCase(f)+": "+mRiverInsertCall, latencyStats{N: res.N, P50: res.InsertCall.P50US, P99: res.InsertCall.P99US}, false)
			addLatency(e.res, "river", riverLatencyCase(f)+": "+mRiverAfterInsert, latencyStats{N: res.N, P50: res.AfterInsert.P50US, P99: res.AfterInsert.P99US}, false)
			e.res.Note("river", "River %s, pool_max_conns=%d", res.RiverVersion, res.PoolMaxConns)
			// What the River binary reports it used, which the names and
			// rules abbreviate.
			if res.ClientSynchronousCommit == "" {
				e.res.Note("river", "'%s': FetchCooldown %s, FetchPollInterval %s (as bench/river reports them)", f.Name, res.FetchCooldown, res.FetchPollInterval)
			} else {
				e.res.Note("river", "'%s': FetchCooldown %s, FetchPollInterval %s, synchronous_commit=%s on the client's pool and =%s on the insert pool (as bench/river reports them)",
					f.Name, res.FetchCooldown, res.FetchPollInterval, res.ClientSynchronousCommit, res.InsertSynchronousCommit)
			}
			return nil
		}
		if !f.BackToBack {
			if err := theirs(); err != nil {
				return err
			}
		} else {
			// Both of Bellhop's paths beside River's, the default one
			// right next to it: leasing, default, River in odd runs;
			// River, default, leasing in even ones. An informational
			// configuration has the default path alone beside it.
			withLease := !f.Informational
			var ours, leased latencyStats
			label := fmt.Sprintf("Bellhop %s, next to %s", caseGo, riverLatencyCase(f))
			leaseLabel := fmt.Sprintf("Bellhop %s, next to %s", caseGoLease, riverLatencyCase(f))
			lease := func() (err error) {
				if leased, err = latencyOnce(ctx, e, caseGoLease, run, reportAs{"river", leaseLabel}); err != nil {
					return fmt.Errorf("%s: %w", leaseLabel, err)
				}
				return nil
			}
			if withLease && run%2 != 0 {
				if err := lease(); err != nil {
					return err
				}
			}
			err := backToBack(run, label, func() (err error) {
				ours, err = latencyOnce(ctx, e, caseGo, run, reportAs{"river", label})
				return err
			}, theirs)
			if err != nil {
				return err
			}
			if withLease && run%2 == 0 {
				if err := lease(); err != nil {
					return err
				}
			}
			e.res.Add(Metric{Scenario: "river", Case: backToBackCase(f), Name: f.latencyRatio(), Unit: "×", LowerIsBetter: true}, ours.P50/res.P50US)
			if withLease {
				e.res.Add(Metric{Scenario: "river", Case: backToBackCase(f), Name: mLatencyRatioLease, Unit: "×", LowerIsBetter: true}, leased.P50/res.P50US)
			}
		}
		if f.Informational {
			continue // latency only
		}
		for _, w := range e.p.riverWorkers {
			var jobs float64
			cas := riverBurndownCase(f, e.p.riverBurndownN, w)
			theirs := func() error {
				var b struct {
					Seconds         float64 `json:"seconds"`
					JobsPerSec      float64 `json:"jobs_per_sec"`
					WorkedSeconds   float64 `json:"worked_seconds"`
					Checkpointed    bool    `json:"checkpointed"`
					CheckpointError string  `json:"checkpoint_error"`
				}
				// -checkpoint: Bellhop's backlog is CHECKPOINTed after its
				// VACUUM ANALYZE too (throughputOnce), so that neither
				// burn-down meets the checkpoint its insert's WAL brings.
				args := append([]string{"-scenario", "burndown", "-n", strconv.Itoa(e.p.riverBurndownN), "-workers", strconv.Itoa(w), "-checkpoint"}, f.Args...)
				if err := e.river(ctx, args, &b); err != nil {
					return fmt.Errorf("%s: %w", cas, err)
				}
				if !b.Checkpointed {
					e.res.Note("river", "River's CHECKPOINT before the burn-down failed (%s); cases may overlap a checkpoint", b.CheckpointError)
				}
				e.res.Add(Metric{Scenario: "river", Case: cas, Name: mRiverWorked, Unit: "jobs/s"}, rate(e.p.riverBurndownN, time.Duration(b.WorkedSeconds*float64(time.Second))))
				e.res.Add(Metric{Scenario: "river", Case: cas, Name: mRiverJobs, Unit: "jobs/s"}, b.JobsPerSec)
				jobs = b.JobsPerSec
				return nil
			}
			i := slices.IndexFunc(burnDownPairs, func(p burnDownPair) bool { return p.workers == w })
			if !f.BackToBack || i < 0 {
				if err := theirs(); err != nil {
					return err
				}
				continue
			}
			c := throughputCase{N: e.p.riverBurndownN, Queues: 1, InFlight: burnDownPairs[i].inFlight}
			label := fmt.Sprintf("Bellhop %s, next to %s", c, cas)
			var ours float64
			err := backToBack(run, label, func() (err error) {
				ours, err = throughputOnce(ctx, e, run, c, reportAs{"river", label})
				return err
			}, theirs)
			if err != nil {
				return err
			}
			e.res.Add(Metric{Scenario: "river", Case: backToBackCase(f), Name: burnDownRatio(c.InFlight, w), Unit: "×"}, ours/jobs)
		}
	}
	e.res.Note("river", "bench/river (a separate module) run as a subprocess against the same server, a fresh database per run, unix socket, -max-conns %d (the Bellhop dispatcher's pool size); latency: -n %d -interval %s (one Insert per transaction, timed from just before Insert to the start of Work; '%s' is how long client.Insert took, commit included, and '%s' the rest, as Bellhop's 'Enqueue call' and 'Enqueue returned → handler'); burn-down: InsertManyFast in batches of 1,000, VACUUM ANALYZE river_job and CHECKPOINT (-checkpoint; as before Bellhop's burn-down), then timed from client.Start until River reports every job completed",
		e.p.poolMaxConns, e.p.riverLatencyN, e.p.latencyInterval, mRiverInsertCall, mRiverAfterInsert)
	e.res.Note("river", "'Bellhop …, next to River …': Bellhop's case measured as in scenarios 2 and 3, right before River's in odd runs and right after it in even ones; '%s' holds the ratio of each such pair (Bellhop's latency p50 over River's; Bellhop's msgs/s to table empty over River's jobs/s to completed in DB), and its median is the ratio of the targets marked 'back to back'", backToBackCase(riverFetches[1]))
	e.res.Note("river", "not like-for-like: River's latency runs use bench/river's default of 100 workers (-workers is passed to its burn-downs only), against Bellhop's one consumer at MaxInFlight %d; and Bellhop's dispatcher commits its claims and acks with synchronous_commit=off (NewDispatcher sets it) while River's client commits with the server's setting (on), except in the informational configuration that says otherwise", bellhop.DefaultMaxInFlight)
	e.res.Note("river", "the Bellhop cases here keep no pg_stat_statements window in any run (this scenario has no evidence run); the same cases' statements are in the latency and throughput scenarios' evidence runs")
	for _, f := range riverFetches {
		if f.Informational {
			e.res.Note("river", "'%s' is informational: no target reads its figures; its settings: %s; '%s' in '%s' is Bellhop's %s p50 over its p50, the pair measured back to back as above (without the leasing case)",
				f.Name, f.Settings, f.latencyRatio(), backToBackCase(f), caseGo)
		}
	}
	e.res.Note("river", "'%s, next to River …': measured right before the default path's pair in odd runs (leasing, default, River) and right after it in even ones (River, default, leasing); '%s' is its p50 over the same River p50", caseGoLease, mLatencyRatioLease)
	return nil
}

// river runs the River benchmark binary on a fresh database and decodes
// its JSON result into out.
func (e *env) river(ctx context.Context, args []string, out any) error {
	db, err := e.srv.newDatabase(ctx, "river", false)
	if err != nil {
		return err
	}
	defer db.drop()
	args = append([]string{"-database-url", db.DSN, "-max-conns", strconv.Itoa(e.p.poolMaxConns), "-timeout", "20m"}, args...)
	cmd := exec.CommandContext(ctx, e.riverBin, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("riverbench %s: %v: %s", strings.Join(args[2:], " "), err, tail(stderr.String(), 800))
	}
	if err := json.Unmarshal(stdout.Bytes(), out); err != nil {
		return fmt.Errorf("riverbench output %q: %w", tail(stdout.String(), 200), err)
	}
	return nil
}

func tail(s string, n int) string {
	s = strings.TrimSpace(s)
	if len(s) > n {
		return "…" + s[len(s)-n:]
	}
	return s
}
