package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"runtime/debug"
	"slices"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
	"github.com/riverqueue/river/rivertype"
)

// riverModule is the module path whose version is reported in the results.
const riverModule = "github.com/riverqueue/river"

// common holds the result fields shared by both scenarios.
type common struct {
	Scenario          string `json:"scenario"`
	N                 int    `json:"n"`
	FetchCooldown     string `json:"fetch_cooldown"`
	FetchPollInterval string `json:"fetch_poll_interval"`
	Workers           int    `json:"workers"`
	PoolMaxConns      int32  `json:"pool_max_conns"`
	Schema            string `json:"schema"`
	RiverVersion      string `json:"river_version"`
	// ClientSynchronousCommit and InsertSynchronousCommit are set only
	// with -client-synchronous-commit: synchronous_commit as SHOW reports
	// it on the River client's pool (fetches, completions, maintenance)
	// and on the separate pool the jobs are inserted on.
	ClientSynchronousCommit string `json:"client_synchronous_commit,omitempty"`
	InsertSynchronousCommit string `json:"insert_synchronous_commit,omitempty"`
}

// latencyResult is the JSON object printed by the latency scenario. Latencies
// are from just before the insert call to the start of the worker's Work, in
// microseconds.
type latencyResult struct {
	common
	Interval string `json:"interval"`
	P50US    int64  `json:"p50_us"`
	P90US    int64  `json:"p90_us"`
	P99US    int64  `json:"p99_us"`
	MaxUS    int64  `json:"max_us"`
	MeanUS   int64  `json:"mean_us"`
	// InsertCall is how long client.Insert took (INSERT, commit and its
	// WAL flush), and AfterInsert the rest of each latency, from Insert's
	// return to the start of Work: the producer's and the fetcher's
	// shares, as Bellhop's latency scenario splits its own.
	InsertCall  split `json:"insert_call"`
	AfterInsert split `json:"insert_returned_to_work"`
}

// split holds two percentiles of one part of the latency, in microseconds.
type split struct {
	P50US int64 `json:"p50_us"`
	P99US int64 `json:"p99_us"`
}

// splitOf returns the p50 and p99 of ns (nanoseconds), which it sorts.
func splitOf(ns []int64) split {
	slices.Sort(ns)
	return split{P50US: percentile(ns, 0.50) / 1000, P99US: percentile(ns, 0.99) / 1000}
}

// burndownResult is the JSON object printed by the burndown scenario.
type burndownResult struct {
	common
	// Seconds is from just before client.Start until River has reported the
	// last of the N jobs as completed (i.e. its completer has marked it
	// completed in the database).
	Seconds    float64 `json:"seconds"`
	JobsPerSec float64 `json:"jobs_per_sec"`
	// WorkedSeconds is from just before client.Start until the last Work call
	// returned; the completer may still have been marking jobs then.
	WorkedSeconds float64 `json:"worked_seconds"`
	// StartSeconds is how long client.Start took (part of Seconds).
	StartSeconds float64 `json:"start_seconds"`
	// InsertSeconds is how long the bulk insert took (not part of Seconds).
	InsertSeconds float64 `json:"insert_seconds"`
	BatchSize     int     `json:"batch_size"`
	// Checkpointed: -checkpoint was given and the CHECKPOINT after the
	// VACUUM ANALYZE succeeded; CheckpointError says why it did not.
	Checkpointed    bool   `json:"checkpointed"`
	CheckpointError string `json:"checkpoint_error,omitempty"`
}

// run prepares the database and runs the scenario chosen in opts.
//
// Without -client-synchronous-commit one pool serves everything: the
// River client fetches, completes and inserts on it. With it, the
// client's pool sets synchronous_commit, and a second pool, with the
// connection string's settings alone, prepares the schema and takes the
// inserts, through an insert-only client, so that only the worker side's
// commits change.
func run(ctx context.Context, opts *options, logger *slog.Logger) (any, error) {
	clientCfg, insertCfg, err := poolConfigs(opts)
	if err != nil {
		return nil, err
	}
	pool, err := openPool(ctx, clientCfg)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	insertPool := pool
	if insertCfg != nil {
		if insertPool, err = openPool(ctx, insertCfg); err != nil {
			return nil, err
		}
		defer insertPool.Close()
	}

	if err := prepareSchema(ctx, insertPool, opts.Schema, logger); err != nil {
		return nil, err
	}
	if _, err := insertPool.Exec(ctx, "TRUNCATE "+opts.Schema+".river_job"); err != nil {
		return nil, fmt.Errorf("truncating river_job: %w", err)
	}

	c := common{
		Scenario:          opts.Scenario,
		N:                 opts.N,
		FetchCooldown:     opts.effectiveFetchCooldown().String(),
		FetchPollInterval: opts.effectiveFetchPollInterval().String(),
		Workers:           opts.Workers,
		PoolMaxConns:      pool.Config().MaxConns,
		Schema:            opts.Schema,
		RiverVersion:      moduleVersion(riverModule),
	}
	if insertCfg != nil {
		// What the server applied, not what was asked for.
		for _, x := range []struct {
			pool *pgxpool.Pool
			into *string
		}{{pool, &c.ClientSynchronousCommit}, {insertPool, &c.InsertSynchronousCommit}} {
			if err := x.pool.QueryRow(ctx, "SHOW synchronous_commit").Scan(x.into); err != nil {
				return nil, fmt.Errorf("reading synchronous_commit: %w", err)
			}
		}
	}
	switch opts.Scenario {
	case scenarioLatency:
		return runLatency(ctx, pool, insertPool, opts, logger, c)
	case scenarioBurndown:
		return runBurndown(ctx, pool, insertPool, opts, logger, c)
	}
	return nil, fmt.Errorf("unknown scenario %q", opts.Scenario)
}

// poolConfigs returns the configuration of the River client's pool and,
// with -client-synchronous-commit, that of a separate pool for the
// inserts (nil without it: the client's pool takes them, as it always
// has). Only the client's pool sets synchronous_commit; the insert pool
// keeps what the connection string and the server say (the default, on).
func poolConfigs(opts *options) (client, insert *pgxpool.Config, err error) {
	if client, err = poolConfig(opts); err != nil {
		return nil, nil, err
	}
	if opts.ClientSynchronousCommit == "" {
		return client, nil, nil
	}
	client.ConnConfig.RuntimeParams["synchronous_commit"] = opts.ClientSynchronousCommit
	if insert, err = poolConfig(opts); err != nil {
		return nil, nil, err
	}
	return client, insert, nil
}

// poolConfig parses a pool configuration whose connections use opts.Schema
// as search_path, as River's driver expects ("The pool should already be
// configured to use the schema specified in the client's Schema field").
func poolConfig(opts *options) (*pgxpool.Config, error) {
	cfg, err := pgxpool.ParseConfig(opts.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("parsing -database-url: %w", err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = opts.Schema
	if opts.MaxConns > 0 {
		cfg.MaxConns = int32(opts.MaxConns)
	}
	return cfg, nil
}

// openPool opens a pgx pool with cfg (from poolConfig) and checks that it
// connects.
func openPool(ctx context.Context, cfg *pgxpool.Config) (*pgxpool.Pool, error) {
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connecting: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("connecting: %w", err)
	}
	return pool, nil
}

// prepareSchema creates schema if it is missing and runs River's migrations
// up into it.
func prepareSchema(ctx context.Context, pool *pgxpool.Pool, schema string, logger *slog.Logger) error {
	if _, err := pool.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{schema}.Sanitize()); err != nil {
		return fmt.Errorf("creating schema %s: %w", schema, err)
	}
	migrator, err := rivermigrate.New(riverpgxv5.New(pool), &rivermigrate.Config{
		Logger: logger,
		Schema: schema,
	})
	if err != nil {
		return fmt.Errorf("creating migrator: %w", err)
	}
	res, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil)
	if err != nil {
		return fmt.Errorf("migrating River into schema %s: %w", schema, err)
	}
	if len(res.Versions) > 0 {
		logger.Info("applied River migrations", "schema", schema, "count", len(res.Versions),
			"last", res.Versions[len(res.Versions)-1].Version)
	}
	return nil
}

// newClient builds a River client working the single queue "default" with
// the fetch settings and worker count from opts.
func newClient(pool *pgxpool.Pool, opts *options, logger *slog.Logger, workers *river.Workers) (*river.Client[pgx.Tx], error) {
	client, err := river.NewClient(riverpgxv5.New(pool), clientConfig(opts, logger, workers))
	if err != nil {
		return nil, fmt.Errorf("creating River client: %w", err)
	}
	return client, nil
}

// clientConfig is the configuration of newClient's client.
func clientConfig(opts *options, logger *slog.Logger, workers *river.Workers) *river.Config {
	return &river.Config{
		FetchCooldown:     opts.FetchCooldown,     // 0 = River's default
		FetchPollInterval: opts.FetchPollInterval, // 0 = River's default
		Logger:            logger,
		Queues: map[string]river.QueueConfig{
			river.QueueDefault: {MaxWorkers: opts.Workers},
		},
		Schema:  opts.Schema,
		Workers: workers,
	}
}

// insertClientConfig is clientConfig without the queues: the client it
// configures only inserts. The rest must stay the same: River limits a
// client's insert notifications to one per queue per FetchCooldown (its
// insertNotifyLimiter), so an inserter at the default cooldown (100 ms)
// would leave most jobs 10 ms apart to the worker's poll.
func insertClientConfig(opts *options, logger *slog.Logger, workers *river.Workers) *river.Config {
	cfg := clientConfig(opts, logger, workers)
	cfg.Queues = nil
	return cfg
}

// inserterFor returns the client that inserts a scenario's jobs: client
// itself if insertPool is the client's own pool, otherwise an insert-only
// client (no queues: it never fetches or works) on insertPool,
// configured as client is (insertClientConfig), so that it validates the
// job kind and sends insert notifications as client would, down the
// same code path, Insert and InsertManyFast.
func inserterFor(client *river.Client[pgx.Tx], pool, insertPool *pgxpool.Pool, opts *options, logger *slog.Logger, workers *river.Workers) (*river.Client[pgx.Tx], error) {
	if insertPool == pool {
		return client, nil
	}
	inserter, err := river.NewClient(riverpgxv5.New(insertPool), insertClientConfig(opts, logger, workers))
	if err != nil {
		return nil, fmt.Errorf("creating River's insert-only client: %w", err)
	}
	return inserter, nil
}

// stopClient stops client cleanly, waiting at most timeout; if that fails it
// falls back to StopAndCancel. It is safe to call on a client that is already
// stopped.
func stopClient(client *river.Client[pgx.Tx], timeout time.Duration, logger *slog.Logger) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	err := client.Stop(ctx)
	if err == nil {
		return nil
	}
	logger.Warn("River client did not stop in time; cancelling its jobs", "err", err)
	hardCtx, hardCancel := context.WithTimeout(context.Background(), timeout)
	defer hardCancel()
	if err2 := client.StopAndCancel(hardCtx); err2 != nil {
		return fmt.Errorf("stopping River client: %w", errors.Join(err, err2))
	}
	return fmt.Errorf("stopping River client: %w", err)
}

// latencyArgs are the arguments of a latency job.
type latencyArgs struct {
	// Seq numbers the jobs 0..n-1.
	Seq int `json:"seq"`
	// EnqueuedAtOffset is when, just before the insert, on the monotonic
	// clock in nanoseconds since the run's base (latencyWorker.base): the
	// same process inserts and works the jobs, so the offset means the
	// same on both sides, and a step of the wall clock between them
	// (NTP) does not enter the latency as a wall-clock instant would.
	EnqueuedAtOffset int64 `json:"enqueued_at_offset_nanos"`
}

// Kind implements river.JobArgs.
func (latencyArgs) Kind() string { return "bench_latency" }

// latencyWorker records, at the start of Work, how long ago each job was
// enqueued.
type latencyWorker struct {
	river.WorkerDefaults[latencyArgs]
	// base is the zero of every offset of the run, taken once.
	base      time.Time
	latencies []int64       // nanoseconds, indexed by Seq
	started   []int64       // nanoseconds since base at the start of Work, indexed by Seq
	seen      []atomic.Bool // guards against counting a job twice
	received  atomic.Int64
	done      chan struct{} // closed when every job has been seen
}

// Work implements river.Worker.
func (w *latencyWorker) Work(_ context.Context, job *river.Job[latencyArgs]) error {
	now := w.since()
	seq := job.Args.Seq
	if seq < 0 || seq >= len(w.latencies) || w.seen[seq].Swap(true) {
		return nil
	}
	w.latencies[seq] = now - job.Args.EnqueuedAtOffset
	w.started[seq] = now
	if w.received.Add(1) == int64(len(w.latencies)) {
		close(w.done)
	}
	return nil
}

// since is the time elapsed since w.base, in nanoseconds.
func (w *latencyWorker) since() int64 { return int64(time.Since(w.base)) }

// runLatency runs the latency scenario: pool is the client's, insertPool
// the one the jobs are inserted on (the same pool unless
// -client-synchronous-commit is set).
func runLatency(ctx context.Context, pool, insertPool *pgxpool.Pool, opts *options, logger *slog.Logger, c common) (_ *latencyResult, err error) {
	worker := &latencyWorker{
		base:      time.Now(),
		latencies: make([]int64, opts.N),
		started:   make([]int64, opts.N),
		seen:      make([]atomic.Bool, opts.N),
		done:      make(chan struct{}),
	}
	workers := river.NewWorkers()
	river.AddWorker(workers, worker)
	client, err := newClient(pool, opts, logger, workers)
	if err != nil {
		return nil, err
	}
	inserter, err := inserterFor(client, pool, insertPool, opts, logger, workers)
	if err != nil {
		return nil, err
	}
	if err := client.Start(ctx); err != nil {
		return nil, fmt.Errorf("starting River client: %w", err)
	}
	defer func() {
		if stopErr := stopClient(client, opts.StopTimeout, logger); stopErr != nil && err == nil {
			err = stopErr
		}
	}()

	// Let the client finish starting its services (listener, leader
	// election, producers) so the first jobs do not pay for that.
	if err := sleepCtx(ctx, opts.Settle); err != nil {
		return nil, err
	}

	begin := time.Now()
	returned := make([]int64, opts.N) // nanoseconds since worker.base at Insert's return
	insertCall := make([]int64, opts.N)
	for i := range opts.N {
		if err := sleepCtx(ctx, time.Until(begin.Add(time.Duration(i)*opts.Interval))); err != nil {
			return nil, err
		}
		args := latencyArgs{Seq: i, EnqueuedAtOffset: worker.since()}
		if _, err := inserter.Insert(ctx, args, nil); err != nil {
			return nil, fmt.Errorf("inserting job %d: %w", i, err)
		}
		returned[i] = worker.since()
		insertCall[i] = returned[i] - args.EnqueuedAtOffset
	}
	logger.Info("inserted all latency jobs", "n", opts.N, "elapsed", time.Since(begin))

	select {
	case <-worker.done:
	case <-ctx.Done():
		return nil, fmt.Errorf("waiting for jobs to be worked (%d of %d seen): %w",
			worker.received.Load(), opts.N, ctx.Err())
	}

	after := make([]int64, opts.N)
	for i := range after {
		after[i] = worker.started[i] - returned[i]
	}
	lat := slices.Clone(worker.latencies)
	slices.Sort(lat)
	var sum float64
	for _, v := range lat {
		sum += float64(v)
	}
	return &latencyResult{
		common:   c,
		Interval: opts.Interval.String(),
		P50US:    percentile(lat, 0.50) / 1000,
		P90US:    percentile(lat, 0.90) / 1000,
		P99US:    percentile(lat, 0.99) / 1000,
		MaxUS:    lat[len(lat)-1] / 1000,
		MeanUS:   int64(math.Round(sum / float64(len(lat)) / 1000)),

		InsertCall:  splitOf(insertCall),
		AfterInsert: splitOf(after),
	}, nil
}

// noopArgs are the arguments of a burndown job.
type noopArgs struct {
	Num int `json:"num"`
}

// Kind implements river.JobArgs.
func (noopArgs) Kind() string { return "bench_noop" }

// noopWorker does nothing but count the jobs it has worked.
type noopWorker struct {
	river.WorkerDefaults[noopArgs]
	n        int64
	worked   atomic.Int64
	start    time.Time // set before the client starts
	workedAt atomic.Int64
}

// Work implements river.Worker.
func (w *noopWorker) Work(context.Context, *river.Job[noopArgs]) error {
	if w.worked.Add(1) == w.n {
		w.workedAt.Store(int64(time.Since(w.start)))
	}
	return nil
}

// runBurndown runs the burndown scenario: pool is the client's,
// insertPool the one the jobs are inserted, vacuumed and counted on (the
// same pool unless -client-synchronous-commit is set).
func runBurndown(ctx context.Context, pool, insertPool *pgxpool.Pool, opts *options, logger *slog.Logger, c common) (_ *burndownResult, err error) {
	worker := &noopWorker{n: int64(opts.N)}
	workers := river.NewWorkers()
	river.AddWorker(workers, worker)
	client, err := newClient(pool, opts, logger, workers)
	if err != nil {
		return nil, err
	}
	inserter, err := inserterFor(client, pool, insertPool, opts, logger, workers)
	if err != nil {
		return nil, err
	}

	// Insert everything before the client starts.
	insertStart := time.Now()
	batch := make([]river.InsertManyParams, 0, opts.BatchSize)
	for i := 0; i < opts.N; {
		batch = batch[:0]
		for ; i < opts.N && len(batch) < opts.BatchSize; i++ {
			batch = append(batch, river.InsertManyParams{Args: noopArgs{Num: i}})
		}
		if _, err := inserter.InsertManyFast(ctx, batch); err != nil {
			return nil, fmt.Errorf("inserting jobs: %w", err)
		}
	}
	insertSeconds := time.Since(insertStart).Seconds()
	logger.Info("inserted burndown jobs", "n", opts.N, "seconds", insertSeconds)

	if _, err := insertPool.Exec(ctx, "VACUUM ANALYZE "+opts.Schema+".river_job"); err != nil {
		return nil, fmt.Errorf("vacuuming river_job: %w", err)
	}
	// The insert's WAL would otherwise bring a checkpoint, and its
	// full-page writes, into the timed burn-down, as Bellhop's benchmark
	// avoids for its own. Without the privilege the run goes on, as
	// Bellhop's does, and the result says so.
	var checkpointed bool
	var checkpointErr string
	if opts.Checkpoint {
		if _, err := insertPool.Exec(ctx, "CHECKPOINT"); err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			checkpointErr = err.Error()
		} else {
			checkpointed = true
		}
	}

	// Count completions as River reports them, i.e. after its completer has
	// marked the jobs completed in the database. The channel holds every event
	// so none can be dropped even if this goroutine falls behind.
	events, unsubscribe := client.SubscribeConfig(&river.SubscribeConfig{
		ChanSize: opts.N + 1024,
		Kinds:    []river.EventKind{river.EventKindJobCompleted, river.EventKindJobFailed, river.EventKindJobCancelled},
	})
	defer unsubscribe()

	worker.start = time.Now()
	if err := client.Start(ctx); err != nil {
		return nil, fmt.Errorf("starting River client: %w", err)
	}
	startSeconds := time.Since(worker.start).Seconds()
	defer func() {
		if stopErr := stopClient(client, opts.StopTimeout, logger); stopErr != nil && err == nil {
			err = stopErr
		}
	}()

	var completed int
	for completed < opts.N {
		select {
		case ev, ok := <-events:
			if !ok {
				return nil, fmt.Errorf("event subscription closed after %d of %d completions", completed, opts.N)
			}
			if ev.Kind != river.EventKindJobCompleted {
				return nil, fmt.Errorf("job %d: unexpected event %s (state %s)", ev.Job.ID, ev.Kind, ev.Job.State)
			}
			completed++
		case <-ctx.Done():
			return nil, fmt.Errorf("waiting for completions (%d of %d completed, %d worked): %w",
				completed, opts.N, worker.worked.Load(), ctx.Err())
		}
	}
	seconds := time.Since(worker.start).Seconds()

	// Cross-check in the database that every job is completed.
	var dbCompleted int
	if err := insertPool.QueryRow(ctx, "SELECT count(*) FROM "+opts.Schema+".river_job WHERE state = $1",
		string(rivertype.JobStateCompleted)).Scan(&dbCompleted); err != nil {
		return nil, fmt.Errorf("counting completed jobs: %w", err)
	}
	if dbCompleted != opts.N {
		return nil, fmt.Errorf("river reported %d completions but the table holds %d completed jobs", completed, dbCompleted)
	}

	return &burndownResult{
		common:        c,
		Seconds:       round(seconds, 4),
		JobsPerSec:    round(float64(opts.N)/seconds, 1),
		WorkedSeconds: round(time.Duration(worker.workedAt.Load()).Seconds(), 4),
		StartSeconds:  round(startSeconds, 4),
		InsertSeconds: round(insertSeconds, 4),
		BatchSize:     opts.BatchSize,

		Checkpointed:    checkpointed,
		CheckpointError: checkpointErr,
	}, nil
}

// percentile returns the nearest-rank p-quantile (0 < p <= 1) of sorted,
// which must not be empty.
func percentile(sorted []int64, p float64) int64 {
	rank := int(math.Ceil(p * float64(len(sorted))))
	rank = max(1, min(rank, len(sorted)))
	return sorted[rank-1]
}

// round rounds v to the given number of decimal places.
func round(v float64, places int) float64 {
	scale := math.Pow10(places)
	return math.Round(v*scale) / scale
}

// sleepCtx sleeps for d (returning at once if d <= 0) or until ctx is done.
func sleepCtx(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// moduleVersion returns the version of module path linked into this binary,
// or "unknown".
func moduleVersion(path string) string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown"
	}
	for _, dep := range info.Deps {
		if dep.Path == path {
			if dep.Replace != nil {
				return dep.Replace.Version
			}
			return dep.Version
		}
	}
	return "unknown"
}
