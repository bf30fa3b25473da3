// Command river-bench measures River (github.com/riverqueue/river) on the same
// two scenarios that Bellhop's benchmark orchestrator runs against Bellhop, so
// the two queues can be compared on one machine and one PostgreSQL.
//
// It lives in its own Go module so that Bellhop itself never depends on River.
// The orchestrator runs it as a subprocess: the results are printed as exactly
// one JSON object on stdout, and every log line goes to stderr. On failure
// nothing is printed on stdout and the exit status is non-zero (2 for a bad
// flag, 1 for any other error).
//
// Scenarios:
//
//   - latency: start a client with one no-op worker, let it settle, then insert
//     -n jobs one per transaction, -interval apart. Each job carries the time
//     taken just before its insert, as an offset on the monotonic clock from a
//     start taken once in this process (which both inserts and works the
//     jobs); the worker records its own offset minus that at the start of
//     Work, so a step of the wall clock cannot corrupt a latency. Reports
//     p50/p90/p99/max in microseconds.
//   - burndown: with no client running, bulk-insert -n no-op jobs, VACUUM
//     ANALYZE the job table (and, with -checkpoint, CHECKPOINT), then start a
//     client and time from Start until all -n jobs have been completed (marked
//     completed in the database by River's completer). Reports seconds and
//     jobs per second.
//
// With -client-synchronous-commit (e.g. off) the River client's pool, on
// which it fetches, completes and runs its maintenance, sets
// synchronous_commit, while the jobs are inserted through an insert-only
// client on a second pool that keeps the connection string's and server's
// setting; the result reports both as SHOW gives them.
//
// River's tables are migrated (with rivermigrate) into their own schema, by
// default "river_bench", so they do not collide with the tables of the public
// schema. The job table is truncated before every run so runs are independent.
//
// Example:
//
//	go run . -database-url "$DSN" -scenario burndown -n 20000 -workers 2000 \
//	    -fetch-cooldown 2ms -fetch-poll-interval 20ms
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/riverqueue/river"
)

// Scenario names accepted by -scenario.
const (
	scenarioLatency  = "latency"
	scenarioBurndown = "burndown"
)

// options holds the parsed and validated command-line flags.
type options struct {
	DatabaseURL       string
	Schema            string
	Scenario          string
	N                 int
	Interval          time.Duration
	FetchCooldown     time.Duration
	FetchPollInterval time.Duration
	Workers           int
	MaxConns          int
	BatchSize         int
	Checkpoint        bool
	Settle            time.Duration
	Timeout           time.Duration
	StopTimeout       time.Duration
	Verbose           bool

	// ClientSynchronousCommit, if not "", is synchronous_commit on the
	// River client's pool only (poolConfigs).
	ClientSynchronousCommit string
}

// effectiveFetchCooldown is the fetch cooldown River will actually use.
func (o *options) effectiveFetchCooldown() time.Duration {
	if o.FetchCooldown == 0 {
		return river.FetchCooldownDefault
	}
	return o.FetchCooldown
}

// effectiveFetchPollInterval is the fetch poll interval River will actually
// use.
func (o *options) effectiveFetchPollInterval() time.Duration {
	if o.FetchPollInterval == 0 {
		return river.FetchPollIntervalDefault
	}
	return o.FetchPollInterval
}

// synchronousCommitValues are the values -client-synchronous-commit takes,
// those of PostgreSQL's synchronous_commit.
var synchronousCommitValues = []string{"on", "off", "local", "remote_write", "remote_apply"}

// schemaRE restricts -schema to plain lower-case identifiers, which need no
// quoting anywhere (search_path, River's Schema prefix, CREATE SCHEMA).
var schemaRE = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// errHelp is returned by parseFlags when -h or -help was given.
var errHelp = flag.ErrHelp

// parseFlags parses and validates args (without the program name). Usage and
// flag errors are written to stderr.
func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("river-bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: river-bench -database-url DSN -scenario latency|burndown [flags]\n\n"+
			"Benchmarks River and prints one JSON object with the results on stdout.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	fs.StringVar(&o.DatabaseURL, "database-url", "", "PostgreSQL connection string (pgx DSN or URL); required")
	fs.StringVar(&o.Schema, "schema", "river_bench", "schema for River's tables; created and migrated if missing")
	fs.StringVar(&o.Scenario, "scenario", "", "scenario to run: latency or burndown; required")
	fs.IntVar(&o.N, "n", 0, "number of jobs (default 2000 for latency, 20000 for burndown)")
	fs.DurationVar(&o.Interval, "interval", 10*time.Millisecond, "latency: time between two inserts")
	fs.DurationVar(&o.FetchCooldown, "fetch-cooldown", 0, "River FetchCooldown; 0 = River's default ("+river.FetchCooldownDefault.String()+")")
	fs.DurationVar(&o.FetchPollInterval, "fetch-poll-interval", 0, "River FetchPollInterval; 0 = River's default ("+river.FetchPollIntervalDefault.String()+")")
	fs.IntVar(&o.Workers, "workers", 100, fmt.Sprintf("MaxWorkers of the queue %q (1..%d)", river.QueueDefault, river.QueueNumWorkersMax))
	fs.IntVar(&o.MaxConns, "max-conns", 0, "pgx pool size; 0 = the DSN's pool_max_conns or pgx's default (max(4, NumCPU))")
	fs.IntVar(&o.BatchSize, "batch-size", 1000, "burndown: jobs per InsertManyFast call")
	fs.BoolVar(&o.Checkpoint, "checkpoint", false, "burndown: CHECKPOINT after the insert's VACUUM ANALYZE, as Bellhop's benchmark does before its burn-down (takes superuser or pg_checkpoint; if it fails, the run goes on and the result says why)")
	fs.StringVar(&o.ClientSynchronousCommit, "client-synchronous-commit", "", "synchronous_commit of the River client's pool only (its fetches, completions and maintenance), e.g. off; the jobs are then inserted through an insert-only client on a second pool that keeps the server's setting; empty = one pool for everything, at the server's setting")
	fs.DurationVar(&o.Settle, "settle", time.Second, "latency: wait after Start before the first insert")
	fs.DurationVar(&o.Timeout, "timeout", 10*time.Minute, "give up on the whole run after this long")
	fs.DurationVar(&o.StopTimeout, "stop-timeout", 30*time.Second, "how long to wait for the client to stop")
	fs.BoolVar(&o.Verbose, "v", false, "log River's info messages to stderr (default: warnings only)")

	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	fail := func(format string, a ...any) (*options, error) {
		err := fmt.Errorf(format, a...)
		fmt.Fprintf(stderr, "river-bench: %v\n", err)
		fs.Usage()
		return nil, err
	}
	if fs.NArg() > 0 {
		return fail("unexpected argument %q", fs.Arg(0))
	}
	if o.DatabaseURL == "" {
		return fail("-database-url is required")
	}
	if !schemaRE.MatchString(o.Schema) {
		return fail("-schema %q: must match %s", o.Schema, schemaRE)
	}
	switch o.Scenario {
	case scenarioLatency:
		if o.N == 0 {
			o.N = 2000
		}
	case scenarioBurndown:
		if o.N == 0 {
			o.N = 20000
		}
	case "":
		return fail("-scenario is required (latency or burndown)")
	default:
		return fail("-scenario %q: must be latency or burndown", o.Scenario)
	}
	if o.N < 1 {
		return fail("-n %d: must be at least 1", o.N)
	}
	if o.Interval < 0 {
		return fail("-interval %s: must not be negative", o.Interval)
	}
	if o.FetchCooldown != 0 && o.FetchCooldown < river.FetchCooldownMin {
		return fail("-fetch-cooldown %s: must be 0 (River's default) or at least %s", o.FetchCooldown, river.FetchCooldownMin)
	}
	if o.FetchPollInterval != 0 && o.FetchPollInterval < river.FetchPollIntervalMin {
		return fail("-fetch-poll-interval %s: must be 0 (River's default) or at least %s", o.FetchPollInterval, river.FetchPollIntervalMin)
	}
	if o.effectiveFetchPollInterval() < o.effectiveFetchCooldown() {
		return fail("fetch poll interval %s is shorter than fetch cooldown %s; River rejects that",
			o.effectiveFetchPollInterval(), o.effectiveFetchCooldown())
	}
	if o.Workers < 1 || o.Workers > river.QueueNumWorkersMax {
		return fail("-workers %d: must be between 1 and %d", o.Workers, river.QueueNumWorkersMax)
	}
	if o.MaxConns < 0 {
		return fail("-max-conns %d: must not be negative", o.MaxConns)
	}
	if o.BatchSize < 1 {
		return fail("-batch-size %d: must be at least 1", o.BatchSize)
	}
	if o.ClientSynchronousCommit != "" && !slices.Contains(synchronousCommitValues, o.ClientSynchronousCommit) {
		return fail("-client-synchronous-commit %q: must be one of %s", o.ClientSynchronousCommit, strings.Join(synchronousCommitValues, ", "))
	}
	if o.Settle < 0 {
		return fail("-settle %s: must not be negative", o.Settle)
	}
	if o.Timeout <= 0 {
		return fail("-timeout %s: must be positive", o.Timeout)
	}
	if o.StopTimeout <= 0 {
		return fail("-stop-timeout %s: must be positive", o.StopTimeout)
	}
	return o, nil
}

func main() {
	opts, err := parseFlags(os.Args[1:], os.Stderr)
	if err != nil {
		if errors.Is(err, errHelp) {
			os.Exit(0)
		}
		os.Exit(2)
	}

	level := slog.LevelWarn
	if opts.Verbose {
		level = slog.LevelInfo
	}
	// River's default logger writes to stdout, which would corrupt the JSON
	// result; every logger here is pinned to stderr.
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))

	ctx, cancel := context.WithTimeout(context.Background(), opts.Timeout)
	defer cancel()

	result, err := run(ctx, opts, logger)
	if err != nil {
		fmt.Fprintf(os.Stderr, "river-bench: %v\n", err)
		cancel()
		os.Exit(1)
	}

	enc := json.NewEncoder(os.Stdout)
	if err := enc.Encode(result); err != nil {
		fmt.Fprintf(os.Stderr, "river-bench: writing result: %v\n", err)
		cancel()
		os.Exit(1)
	}
}
