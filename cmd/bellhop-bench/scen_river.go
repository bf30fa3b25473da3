package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// riverFetch is a River fetch configuration.
type riverFetch struct {
	Name string
	Args []string
}

var riverFetches = []riverFetch{
	{Name: "River defaults"},
	{Name: "River 2ms/20ms", Args: []string{"-fetch-cooldown", "2ms", "-fetch-poll-interval", "20ms"}},
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
// same server, a fresh database each time.
func runRiver(ctx context.Context, e *env, _ int) error {
	if e.riverBin == "" {
		return fmt.Errorf("no River benchmark binary")
	}
	for _, f := range riverFetches {
		var res struct {
			P50US        float64 `json:"p50_us"`
			P90US        float64 `json:"p90_us"`
			P99US        float64 `json:"p99_us"`
			MaxUS        float64 `json:"max_us"`
			RiverVersion string  `json:"river_version"`
			PoolMaxConns int     `json:"pool_max_conns"`
		}
		args := append([]string{"-scenario", "latency", "-n", strconv.Itoa(e.p.riverLatencyN), "-interval", e.p.latencyInterval.String()}, f.Args...)
		if err := e.river(ctx, args, &res); err != nil {
			return fmt.Errorf("%s: %w", riverLatencyCase(f), err)
		}
		addLatency(e.res, "river", riverLatencyCase(f), latencyStats{P50: res.P50US, P90: res.P90US, P99: res.P99US, Max: res.MaxUS}, true)
		e.res.Note("river", "River %s, pool_max_conns=%d", res.RiverVersion, res.PoolMaxConns)
		for _, w := range e.p.riverWorkers {
			var b struct {
				Seconds       float64 `json:"seconds"`
				JobsPerSec    float64 `json:"jobs_per_sec"`
				WorkedSeconds float64 `json:"worked_seconds"`
			}
			args := append([]string{"-scenario", "burndown", "-n", strconv.Itoa(e.p.riverBurndownN), "-workers", strconv.Itoa(w)}, f.Args...)
			if err := e.river(ctx, args, &b); err != nil {
				return fmt.Errorf("%s: %w", riverBurndownCase(f, e.p.riverBurndownN, w), err)
			}
			cas := riverBurndownCase(f, e.p.riverBurndownN, w)
			e.res.Add(Metric{Scenario: "river", Case: cas, Name: mRiverWorked, Unit: "jobs/s"}, rate(e.p.riverBurndownN, time.Duration(b.WorkedSeconds*float64(time.Second))))
			e.res.Add(Metric{Scenario: "river", Case: cas, Name: mRiverJobs, Unit: "jobs/s"}, b.JobsPerSec)
		}
	}
	e.res.Note("river", "bench/river (a separate module) run as a subprocess against the same server, a fresh database per run, unix socket, -max-conns %d (the Bellhop dispatcher's pool size); latency: -n %d -interval %s (one Insert per transaction, timed from just before Insert to the start of Work); burn-down: InsertManyFast in batches of 1,000, VACUUM ANALYZE, then timed from client.Start until River reports every job completed",
		e.p.poolMaxConns, e.p.riverLatencyN, e.p.latencyInterval)
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
