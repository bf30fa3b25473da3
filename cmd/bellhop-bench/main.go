// Command bellhop-bench measures Bellhop against a real PostgreSQL and,
// side by side, River (bench/river) on the same server.
//
// By default it starts a throwaway cluster from the local PostgreSQL
// binaries (internal/pgcluster) with PostgreSQL's default durability
// settings (fsync, synchronous_commit and full_page_writes on) plus
// shared_preload_libraries=pg_stat_statements, listening on TCP and a unix
// socket. With DATABASE_URL (or -database-url) it uses that server
// instead; the -h text lists what its user must be allowed (see
// privilegesHelp).
//
// Every scenario runs -runs times (default 3), each run in a fresh
// database cloned from a migrated template, and the table shows the median
// with the min and max beside it. The targets are evaluated on the
// medians and printed PASS or FAIL. The scenarios that gather evidence
// (wait events, statement windows, CPU profiles) do so in one more run
// after those, whose figures are listed beside the evidence and left out
// of the medians and targets.
//
//	go run ./cmd/bellhop-bench -quick -runs 1          # smoke test
//	go run ./cmd/bellhop-bench -markdown bench.md      # the full run
//	go run ./cmd/bellhop-bench -only latency,river
//
// Scenarios (-only): floor, latency, throughput, retries, load, idle,
// producer, busy, scale, river. See BENCHMARKS.md for what each measures.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"reflect"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/rs/zerolog"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgdsn"
)

// params are a run's sizes; -quick scales them down. The JSON report
// writes them all (MarshalJSON).
type params struct {
	Quick        bool `json:"quick"`
	Runs         int  `json:"runs"`
	poolMaxConns int

	floorN         int
	notifyInterval time.Duration

	latencyN        int
	latencyInterval time.Duration

	throughputSizes    []int
	throughputQueues   []int
	throughputInFlight []int
	prefillBatch       int
	throughputTimeout  time.Duration

	retriesN int

	loadRates    []int
	loadDuration time.Duration

	idleConsumers int
	idleDuration  time.Duration
	idleSettle    time.Duration

	producerConcurrency []int
	producerDuration    time.Duration
	bulkRows            int
	busyBacklog         int

	scaleQueues   int
	scaleRate     int
	scaleDuration time.Duration

	riverLatencyN  int
	riverBurndownN int
	riverWorkers   []int
}

// MarshalJSON writes quick and runs, and under "sizes" every other field
// (the run's sizes, durations and pool size), keyed by its name in snake
// case (floorN as floor_n), durations as Go writes them ("2m0s"): the
// JSON report records the sizes the run used.
func (p params) MarshalJSON() ([]byte, error) {
	sizes := map[string]any{}
	v := reflect.ValueOf(p)
	for i := range v.NumField() {
		f := v.Type().Field(i)
		if f.IsExported() {
			continue
		}
		x, err := sizeValue(v.Field(i))
		if err != nil {
			return nil, fmt.Errorf("params.%s: %w", f.Name, err)
		}
		sizes[snakeCase(f.Name)] = x
	}
	return json.Marshal(struct {
		Quick bool           `json:"quick"`
		Runs  int            `json:"runs"`
		Sizes map[string]any `json:"sizes"`
	}{p.Quick, p.Runs, sizes})
}

// sizeValue is a field of params as MarshalJSON writes it.
func sizeValue(v reflect.Value) (any, error) {
	if v.Type() == reflect.TypeFor[time.Duration]() {
		return time.Duration(v.Int()).String(), nil
	}
	switch v.Kind() {
	case reflect.Int, reflect.Int64:
		return v.Int(), nil
	case reflect.Bool:
		return v.Bool(), nil
	case reflect.Slice:
		out := make([]any, v.Len())
		for i := range out {
			x, err := sizeValue(v.Index(i))
			if err != nil {
				return nil, err
			}
			out[i] = x
		}
		return out, nil
	}
	return nil, fmt.Errorf("no JSON form for %s", v.Type())
}

// snakeCase turns a Go name like riverBurndownN into river_burndown_n.
func snakeCase(name string) string {
	var b strings.Builder
	for i, c := range name {
		if c >= 'A' && c <= 'Z' {
			if i > 0 {
				b.WriteByte('_')
			}
			c += 'a' - 'A'
		}
		b.WriteRune(c)
	}
	return b.String()
}

// fullParams are the sizes.
func fullParams() params {
	return params{
		Runs: 3, poolMaxConns: 20,
		floorN: 2000, notifyInterval: 10 * time.Millisecond,
		latencyN: 2000, latencyInterval: 10 * time.Millisecond,
		throughputSizes: []int{20_000, 200_000}, throughputQueues: []int{1, 100}, throughputInFlight: []int{10, 1000},
		prefillBatch: 5000, throughputTimeout: 15 * time.Minute,
		retriesN:  20_000,
		loadRates: []int{1000, 5000}, loadDuration: 30 * time.Second,
		idleConsumers: 1000, idleDuration: 120 * time.Second, idleSettle: 12 * time.Second,
		producerConcurrency: []int{1, 8, 32, 64}, producerDuration: 10 * time.Second, bulkRows: 10_000, busyBacklog: 150_000,
		scaleQueues: 10_000, scaleRate: 1000, scaleDuration: 20 * time.Second,
		riverLatencyN: 2000, riverBurndownN: 20_000, riverWorkers: []int{10, 2000},
	}
}

// quickParams are about ten times smaller and shorter, for a smoke test.
func quickParams() params {
	p := fullParams()
	p.Quick = true
	p.floorN = 200
	p.latencyN = 200
	p.throughputSizes = []int{2000, 20_000}
	p.throughputTimeout = 5 * time.Minute
	p.retriesN = 2000
	p.loadDuration = 3 * time.Second
	p.idleDuration = 12 * time.Second
	p.idleSettle = 11 * time.Second
	p.producerDuration = time.Second
	p.bulkRows = 1000
	p.busyBacklog = 15_000
	p.scaleQueues = 1000
	p.scaleDuration = 2 * time.Second
	p.riverLatencyN = 200
	p.riverBurndownN = 2000
	return p
}

type scenario struct {
	name, title string
	run         func(ctx context.Context, e *env, run int) error
	// evidence, if not "", is what the scenario gathers (wait events,
	// statement windows, CPU profiles) only in an extra run after the
	// scored ones (env.evidenceRun), so that no scored figure pays for
	// it.
	evidence string
}

var scenarios = []scenario{
	{"floor", "1. Physical floor", runFloor, ""},
	{"latency", "2. Latency, idle dispatcher", runLatency, "a pg_stat_statements window over each case"},
	{"throughput", "3. Throughput (burn-down)", runThroughput, "a pg_stat_statements window over each case and, with -cpuprofile, a CPU profile of each"},
	{"retries", "3b. Burn-down with due retries", runRetries, "a pg_stat_statements window over each case"},
	{"load", "4. Latency under load", runLoad, "wait events of all sessions every 50ms and a pg_stat_statements window over each case"},
	{"idle", "5. Idle load", runIdle, ""},
	{"producer", "6. Producer cost of the notify trigger", runProducer, "wait events of the producers' sessions every 50ms"},
	{"busy", "6b. Producer cost while a dispatcher drains (busy marks)", runBusy, "wait events of the producers' sessions every 50ms"},
	{"scale", "7. Scale in queues", runScale, "for both cases alike, wait events of all sessions every 50ms, a pg_stat_statements window and, with -cpuprofile, a CPU profile"},
	{"river", "8. River side by side", runRiver, ""},
}

// step is one scenario run of a plan.
type step struct {
	sc  scenario
	run int
}

// planRuns orders the scenario runs: the scored runs 1 to runs of each of
// scs and, for a scenario with evidence, its evidence run (runs+1) after
// them, so that its instrumentation does not slow a neighbouring scored
// run either. Sequential keeps each scenario's runs together; otherwise
// run 1 of every scenario comes first, then run 2, and so on, the
// evidence runs last.
func planRuns(scs []scenario, runs int, sequential bool) []step {
	var plan []step
	if sequential {
		for _, sc := range scs {
			for r := 1; r <= runs; r++ {
				plan = append(plan, step{sc, r})
			}
			if sc.evidence != "" {
				plan = append(plan, step{sc, runs + 1})
			}
		}
		return plan
	}
	for r := 1; r <= runs; r++ {
		for _, sc := range scs {
			plan = append(plan, step{sc, r})
		}
	}
	for _, sc := range scs {
		if sc.evidence != "" {
			plan = append(plan, step{sc, runs + 1})
		}
	}
	return plan
}

// runName names run in progress lines and load averages.
func runName(run, runs int) string {
	if run > runs {
		return fmt.Sprintf("evidence run %d (instrumented, not scored)", run)
	}
	return fmt.Sprintf("run %d of %d", run, runs)
}

// evidenceNote says, under sc, which run is the evidence run, what it
// gathers and what becomes of its figures.
func evidenceNote(sc scenario, runs int) string {
	return fmt.Sprintf("run %d, after the %d scored run(s), is the evidence run, the only one to gather %s; its figures are listed under Evidence and are in neither the table's medians nor the targets", runs+1, runs, sc.evidence)
}

func scenarioNames() []string {
	var out []string
	for _, s := range scenarios {
		out = append(out, s.name)
	}
	return out
}

// options are the command line.
type options struct {
	databaseURL string
	only        []string
	runs        int
	quick       bool
	markdown    string
	jsonOut     string
	cpuprofile  string
	riverDir    string
	riverBin    string
	poolMax     int
	verbose     bool
	sequential  bool
	timeline    bool
	dump        string
	// args is the command line, as the report records it (redacted).
	args []string
}

// privilegesHelp is what the user of -database-url must be allowed, for
// the -h text.
const privilegesHelp = "its user needs CREATEDB; pg_read_all_settings (the report reads shared_preload_libraries, or the tool stops); " +
	"for the statement counts, pg_stat_statements preloaded, the extension created in database postgres (the tool tries CREATE EXTENSION, which takes a superuser) " +
	"and EXECUTE on pg_stat_statements_reset (without it the idle scenario fails and the others record no statement evidence); " +
	"and pg_checkpoint (without it the CHECKPOINT before a case is skipped and noted). A superuser has all of these"

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("bellhop-bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: bellhop-bench [flags]\n\nBenchmarks Bellhop (and River, side by side) against PostgreSQL and prints a table.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	only := fs.String("only", "", "comma-separated scenarios to run (default all): "+strings.Join(scenarioNames(), ","))
	// The default is empty, not $DATABASE_URL itself: -h prints defaults,
	// and a URL's password with them.
	fs.StringVar(&o.databaseURL, "database-url", "", "PostgreSQL server to use instead of a throwaway cluster (if empty, $DATABASE_URL; if that is empty too, a throwaway cluster); "+privilegesHelp)
	fs.IntVar(&o.runs, "runs", 3, "runs per scenario; the table shows the median, min and max")
	fs.BoolVar(&o.quick, "quick", false, "about 10x fewer messages and shorter durations, for a smoke test")
	fs.StringVar(&o.markdown, "markdown", "", "also write the report as Markdown to this file")
	fs.StringVar(&o.jsonOut, "json", "", "also write every value, the sizes, the settings and the evidence as JSON to this file")
	fs.StringVar(&o.cpuprofile, "cpuprofile", "", "write CPU profiles of this process to FILE.<case>.pprof in the evidence run (the one after the scored runs, left out of the medians and targets): of each throughput case (Dispatcher.Run → table empty) and of both scale cases (Dispatcher.Run → last delivery)")
	fs.StringVar(&o.riverDir, "river-dir", "", "directory of the River benchmark module (default: bench/river of the module this runs in)")
	fs.StringVar(&o.riverBin, "river-bin", "", "a prebuilt River benchmark binary (skips the build)")
	fs.IntVar(&o.poolMax, "pool-max-conns", 20, "the dispatcher's pool size (and River's)")
	fs.BoolVar(&o.sequential, "sequential", false, "run all runs of a scenario before the next scenario (default: interleaved, run 1 of every scenario, then run 2, ..., so that scenarios compared with each other, Bellhop's and River's, share the machine's changing load)")
	fs.StringVar(&o.dump, "dump", "", "write every message of each latency and scale case run (and of river's back-to-back latency cases) to DIR/<scenario>-<case>-run<N>.csv (enqueued at, Enqueue call, latency, latency from the due time where the producers kept a schedule; µs), to see when the slow ones came")
	fs.BoolVar(&o.timeline, "timeline", false, "print, per second of each load run counted from its first send, how many messages were enqueued and delivered (to stderr)")
	fs.BoolVar(&o.verbose, "v", false, "log the dispatchers' info messages to stderr (default: warnings)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if o.databaseURL == "" {
		o.databaseURL = os.Getenv("DATABASE_URL")
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	if *only != "" {
		for _, s := range strings.Split(*only, ",") {
			s = strings.TrimSpace(s)
			if !slices.Contains(scenarioNames(), s) {
				return nil, fmt.Errorf("-only: unknown scenario %q (have %s)", s, strings.Join(scenarioNames(), ", "))
			}
			o.only = append(o.only, s)
		}
	}
	if o.runs < 1 {
		return nil, fmt.Errorf("-runs %d: must be at least 1", o.runs)
	}
	if o.poolMax < 2 {
		return nil, fmt.Errorf("-pool-max-conns %d: must be at least 2", o.poolMax)
	}
	return o, nil
}

func (o *options) selected(name string) bool {
	return len(o.only) == 0 || slices.Contains(o.only, name)
}

func main() {
	o, err := parseFlags(os.Args[1:], os.Stderr)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintf(os.Stderr, "bellhop-bench: %v\n", err)
		os.Exit(2)
	}
	o.args = os.Args
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	code, err := run(ctx, o, os.Stdout, os.Stderr)
	if err != nil {
		fmt.Fprintf(os.Stderr, "bellhop-bench: %v\n", err)
	}
	os.Exit(code)
}

// Report is everything a run produced, as written to -json.
type Report struct {
	Started    time.Time         `json:"started"`
	Finished   time.Time         `json:"finished"`
	Command    string            `json:"command"`
	Machine    map[string]string `json:"machine"`
	Server     [][2]string       `json:"server_settings"`
	Client     []string          `json:"client_settings"`
	Params     params            `json:"params"`
	Metrics    []Summary         `json:"metrics"`
	Targets    []Target          `json:"targets"`
	Notes      map[string][]string
	Load       []string  `json:"load_averages"`
	Sequential bool      `json:"sequential"`
	Errors     []string  `json:"errors"`
	Evidence   *Evidence `json:"evidence"`
}

// Evidence is what helps explain the figures: the busiest statements of
// some runs, wait events, the CPU profiles written, and the figures of the
// evidence run, which took them.
type Evidence struct {
	Statements []StatementSample `json:"statements"`
	WaitEvents []WaitSample      `json:"wait_events"`
	Profiles   []string          `json:"profiles"`
	// Run is the evidence run, 0 if none ran.
	Run     int              `json:"run"`
	Figures []EvidenceFigure `json:"figures"`
}

// StatementSample is one case's busiest statements, from
// pg_stat_statements, as the JSON report records them.
type StatementSample struct {
	Case string     `json:"case"`
	Top  []stmtStat `json:"top"`
	// TotalCalls is over every statement, not only Top.
	TotalCalls int64 `json:"total_calls"`
}

func (ev *Evidence) addStatements(cas string, st []stmtStat, top int) {
	s := StatementSample{Case: cas, TotalCalls: sumCalls(st)}
	for i, x := range st {
		if i == top {
			break
		}
		x.Query = oneLineSQL(x.Query)
		s.Top = append(s.Top, x)
	}
	ev.Statements = append(ev.Statements, s)
}

// oneLineSQL drops comments and folds white space, for the report.
func oneLineSQL(q string) string {
	var b strings.Builder
	for _, line := range strings.Split(q, "\n") {
		if i := strings.Index(line, "--"); i >= 0 {
			line = line[:i]
		}
		b.WriteString(line)
		b.WriteByte(' ')
	}
	s := strings.Join(strings.Fields(b.String()), " ")
	if len(s) > 160 {
		s = s[:157] + "..."
	}
	return s
}

func run(ctx context.Context, o *options, stdout, stderr io.Writer) (int, error) {
	p := fullParams()
	if o.quick {
		p = quickParams()
	}
	p.Runs = o.runs
	p.poolMaxConns = o.poolMax
	rep := &Report{Started: time.Now(), Command: commandLine(o.args), Machine: machineInfo(), Params: p, Sequential: o.sequential, Evidence: &Evidence{}}

	level := zerolog.WarnLevel
	if o.verbose {
		level = zerolog.InfoLevel
	}
	e := &env{
		p:          p,
		log:        zerolog.New(zerolog.ConsoleWriter{Out: stderr, TimeFormat: "15:04:05"}).Level(level).With().Timestamp().Logger(),
		progress:   stderr,
		res:        newResults(),
		evidence:   rep.Evidence,
		base:       time.Now(),
		cpuprofile: o.cpuprofile,
		timeline:   o.timeline,
		dump:       o.dump,
	}
	// A bad output path fails now, not after a run of an hour; it is a
	// bad flag (status 2).
	if err := o.checkPaths(); err != nil {
		return 2, err
	}
	tmp, err := os.MkdirTemp("", "bellhop-bench")
	if err != nil {
		return 1, err
	}
	defer os.RemoveAll(tmp)
	if o.selected("river") {
		if o.riverBin != "" {
			e.riverBin = o.riverBin
		} else {
			dir := o.riverDir
			if dir == "" {
				dir = defaultRiverDir()
			}
			e.logf("building the River benchmark in %s", dir)
			if e.riverBin, err = buildRiver(ctx, dir, tmp); err != nil {
				return 1, err
			}
		}
	}

	e.logf("starting PostgreSQL (%s)", serverDesc(o.databaseURL))
	e.srv, err = startServer(ctx, o.databaseURL, nil)
	if err != nil {
		// The URL's password must not reach the terminal in an error
		// that quotes the URL.
		return 1, pgdsn.RedactError(err, o.databaseURL)
	}
	defer func() {
		if err := e.srv.close(); err != nil {
			fmt.Fprintf(stderr, "bellhop-bench: stopping PostgreSQL: %v\n", err)
		}
	}()
	rep.Server = e.srv.settings
	rep.Client = []string{
		fmt.Sprintf("dispatcher pool: pool_max_conns=%d; dispatcher sessions: synchronous_commit=off (set by bellhop.NewDispatcher)", p.poolMaxConns),
		"producers: one pgxpool per scenario run, server default synchronous_commit, connections opened before measuring",
		"setup (registering consumers, pre-inserting backlogs; not measured): synchronous_commit=off for speed",
		fmt.Sprintf("dispatcher defaults otherwise: PollInterval %s, consumer MaxInFlight %d unless stated", bellhop.DefaultPollInterval, bellhop.DefaultMaxInFlight),
		fmt.Sprintf("GOMAXPROCS=%d, %s", runtime.GOMAXPROCS(0), runtime.Version()),
	}
	if !e.srv.pss {
		rep.Client = append(rep.Client, "pg_stat_statements is NOT available: idle statements not counted")
	}

	e.res.SetEvidenceRun(p.Runs + 1)
	for _, st := range planRuns(scenarios, p.Runs, o.sequential) {
		sc, r := st.sc, st.run
		if !o.selected(sc.name) || ctx.Err() != nil {
			continue
		}
		// The load averages and the errors name the evidence run as such:
		// its number alone would read as one more scored run.
		name := fmt.Sprintf("run %d", r)
		if e.evidenceRun(r) {
			name = fmt.Sprintf("evidence run %d", r)
			rep.Evidence.Run = r
			e.res.Note(sc.name, "%s", evidenceNote(sc, p.Runs))
		}
		la := loadavg()
		e.logf("%s: %s (load average %s)", sc.title, runName(r, p.Runs), la)
		t0 := time.Now()
		c0, cok := readCPUTimes()
		e.res.StartRun(r)
		err := sc.run(ctx, e, r)
		cpu := "cpu unknown"
		if c1, ok := readCPUTimes(); ok && cok {
			cpu = cpuShare(c0, c1)
		}
		rep.Load = append(rep.Load, fmt.Sprintf("%s %s: load average %s at start, %s at end (%s); %s", sc.name, name, la, loadavg(), time.Since(t0).Round(time.Second), cpu))
		if err != nil {
			e.res.FailRun(sc.name, r)
			msg := fmt.Sprintf("%s %s: %v", sc.name, name, pgdsn.RedactError(err, o.databaseURL))
			e.res.Errors = append(e.res.Errors, msg)
			e.logf("FAILED %s", msg)
			continue
		}
		e.logf("%s: %s done in %s (%s)", sc.title, name, time.Since(t0).Round(100*time.Millisecond), cpu)
	}

	rep.Finished = time.Now()
	rep.Metrics = e.res.Summaries()
	rep.Targets = evaluateTargets(e.res, p)
	for _, w := range loadRateWarnings(e.res, p) {
		e.res.Note("load", "%s", w)
	}
	rep.Notes = e.res.notes
	rep.Errors = e.res.Errors
	rep.Evidence.Figures = e.res.EvidenceFigures()

	writeReport(stdout, rep, false)
	// The two files are written independently: one that fails does not
	// cost the other.
	var errs []error
	if err := writeOutputs(o, rep); err != nil {
		errs = append(errs, err)
	}
	if ctx.Err() != nil {
		errs = append(errs, ctx.Err())
	} else if len(rep.Errors) > 0 {
		errs = append(errs, fmt.Errorf("%d scenario run(s) failed", len(rep.Errors)))
	}
	if len(errs) > 0 {
		return 1, errors.Join(errs...)
	}
	return 0, nil
}

// writeOutputs writes the -markdown and -json files, each attempted
// whether or not the other failed, and returns both errors.
func writeOutputs(o *options, rep *Report) error {
	var errs []error
	if o.markdown != "" {
		var b strings.Builder
		writeReport(&b, rep, true)
		if err := os.WriteFile(o.markdown, []byte(b.String()), 0o644); err != nil {
			errs = append(errs, fmt.Errorf("-markdown: %w", err))
		}
	}
	if o.jsonOut != "" {
		b, err := json.MarshalIndent(rep, "", "  ")
		if err == nil {
			err = os.WriteFile(o.jsonOut, b, 0o644)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("-json: %w", err))
		}
	}
	return errors.Join(errs...)
}

// checkPaths checks, before anything runs, every path the run will
// write or use later: that the -markdown and -json files and the
// -cpuprofile files can be created (without changing a file that exists),
// that the -dump directory exists or can be made and takes files, and,
// when river runs, that -river-bin is an executable file. It returns
// every problem found.
func (o *options) checkPaths() error {
	var errs []error
	for _, f := range []struct{ flag, path string }{{"-markdown", o.markdown}, {"-json", o.jsonOut}} {
		if f.path == "" {
			continue
		}
		if err := checkWritable(f.path); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", f.flag, err))
		}
	}
	if o.cpuprofile != "" {
		// The profiles are PREFIX.<case>.pprof, beside the prefix.
		prefix := strings.TrimSuffix(o.cpuprofile, ".pprof")
		if err := checkDirTakesFiles(filepath.Dir(prefix), filepath.Base(prefix)+".*.pprof"); err != nil {
			errs = append(errs, fmt.Errorf("-cpuprofile: %w", err))
		}
	}
	if o.dump != "" {
		err := os.MkdirAll(o.dump, 0o755)
		if err == nil {
			err = checkDirTakesFiles(o.dump, ".bellhop-bench-check-*")
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("-dump: %w", err))
		}
	}
	if o.riverBin != "" && o.selected("river") {
		fi, err := os.Stat(o.riverBin)
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("-river-bin: %w", err))
		case !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0:
			errs = append(errs, fmt.Errorf("-river-bin: %s is not an executable file", o.riverBin))
		}
	}
	return errors.Join(errs...)
}

// checkWritable checks that the file at path can be written: a file that
// exists is opened for writing but not truncated; otherwise it is
// created and removed again.
func checkWritable(path string) error {
	if fi, err := os.Stat(path); err == nil {
		if fi.IsDir() {
			return fmt.Errorf("%s is a directory", path)
		}
		f, err := os.OpenFile(path, os.O_WRONLY, 0)
		if err != nil {
			return err
		}
		return f.Close()
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return err
	}
	f.Close()
	return os.Remove(path)
}

// checkDirTakesFiles checks that a file named by pattern (as
// os.CreateTemp takes it) can be created in dir, and removes it.
func checkDirTakesFiles(dir, pattern string) error {
	f, err := os.CreateTemp(dir, pattern)
	if err != nil {
		return err
	}
	f.Close()
	return os.Remove(f.Name())
}

// commandLine is args as the report records them, with the password of
// a -database-url value hidden: the report goes to stdout and to files
// that get shared.
func commandLine(args []string) string {
	out := slices.Clone(args)
	for i := 0; i < len(out); i++ {
		name, value, hasValue := strings.Cut(strings.TrimLeft(out[i], "-"), "=")
		if !strings.HasPrefix(out[i], "-") || name != "database-url" {
			continue
		}
		if hasValue {
			out[i] = out[i][:len(out[i])-len(value)] + pgdsn.Redact(value)
		} else if i+1 < len(out) {
			i++
			out[i] = pgdsn.Redact(out[i])
		}
	}
	return strings.Join(out, " ")
}

func runOrder(sequential bool) string {
	if sequential {
		return "sequential: all runs of a scenario, then the next scenario"
	}
	return "interleaved: run 1 of every scenario, then run 2 of every scenario, and so on"
}

func serverDesc(databaseURL string) string {
	if databaseURL != "" {
		return "DATABASE_URL"
	}
	return "throwaway cluster, default durability, pg_stat_statements, TCP and unix socket"
}

// defaultRiverDir finds bench/river next to the main module's go.mod,
// looking up from the working directory.
func defaultRiverDir() string {
	dir, err := os.Getwd()
	if err != nil {
		return "bench/river"
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "bench", "river", "go.mod")); err == nil {
			return filepath.Join(dir, "bench", "river")
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "bench/river"
		}
		dir = parent
	}
}

// machineInfo describes the machine the run is on.
func machineInfo() map[string]string {
	m := map[string]string{
		"nproc":      fmt.Sprint(runtime.NumCPU()),
		"go":         runtime.Version(),
		"goos/arch":  runtime.GOOS + "/" + runtime.GOARCH,
		"cpu":        "unknown",
		"memory":     "unknown",
		"kernel":     "unknown",
		"bellhop_go": buildVersion(),
		"bellhop":    gitRevision(),
	}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				m["cpu"] = strings.TrimSpace(v)
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "MemTotal:"); ok {
				var kb int64
				fmt.Sscan(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), &kb)
				m["memory"] = fmt.Sprintf("%.1f GiB", float64(kb)/(1<<20))
			}
		}
	}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m["kernel"] = strings.TrimSpace(string(b))
	}
	return m
}

// gitRevision describes the working tree the benchmark was run from:
// HEAD and how many files differ from it (the benchmark measures the
// working tree, which go run builds).
func gitRevision() string {
	dir, err := os.Getwd()
	if err != nil {
		return "unknown"
	}
	head, err := exec.Command("git", "-C", dir, "rev-parse", "--short", "HEAD").Output()
	if err != nil {
		return "unknown (not a git checkout)"
	}
	st, _ := exec.Command("git", "-C", dir, "status", "--porcelain", "--untracked-files=no").Output()
	n := len(strings.Fields(strings.TrimSpace(string(st)))) / 2
	return fmt.Sprintf("commit %s, %d tracked file(s) modified in the working tree", strings.TrimSpace(string(head)), n)
}

func buildVersion() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown"
	}
	for _, s := range bi.Settings {
		if s.Key == "vcs.revision" {
			return s.Value
		}
	}
	return bi.Main.Version
}

// writeReport prints the report, as text or Markdown.
func writeReport(w io.Writer, rep *Report, md bool) {
	h := func(level int, title string) {
		if md {
			fmt.Fprintf(w, "\n%s %s\n\n", strings.Repeat("#", level), title)
		} else {
			fmt.Fprintf(w, "\n== %s ==\n", title)
		}
	}
	sub := func(format string, args ...any) {
		if md {
			fmt.Fprintf(w, "  - "+format+"\n", args...)
		} else {
			fmt.Fprintf(w, "      "+format+"\n", args...)
		}
	}
	item := func(format string, args ...any) {
		if md {
			fmt.Fprintf(w, "- "+format+"\n", args...)
		} else {
			fmt.Fprintf(w, "  "+format+"\n", args...)
		}
	}
	mode := "full"
	if rep.Params.Quick {
		mode = "QUICK (scaled down; not the issue's sizes)"
	}
	h(2, fmt.Sprintf("bellhop-bench: %s run, %d run(s) per scenario, %s", mode, rep.Params.Runs, rep.Started.Format(time.RFC3339)))
	item("command: `%s`", rep.Command)
	item("duration: %s", rep.Finished.Sub(rep.Started).Round(time.Second))
	item("bellhop: %s", rep.Machine["bellhop"])
	keys := []string{"cpu", "nproc", "memory", "kernel", "go", "goos/arch"}
	var parts []string
	for _, k := range keys {
		parts = append(parts, k+" "+rep.Machine[k])
	}
	item("machine: %s", strings.Join(parts, ", "))
	var ss []string
	for _, kv := range rep.Server {
		ss = append(ss, kv[0]+"="+kv[1])
	}
	item("server: %s", strings.Join(ss, ", "))
	for _, c := range rep.Client {
		item("client: %s", c)
	}
	item("runs: %s", runOrder(rep.Sequential))
	if rep.Evidence.Run > 0 {
		var names []string
		for _, sc := range scenarios {
			if sc.evidence != "" {
				names = append(names, sc.name)
			}
		}
		list := strings.Join(names[:len(names)-1], ", ") + " and " + names[len(names)-1]
		item("evidence run: run %d of %s, after their scored runs, is the only one that samples wait events, keeps pg_stat_statements windows and writes CPU profiles; its figures are under Evidence, not in the medians or the targets. Every run of a latency case (scenarios latency and river) times the dispatcher's claim passes with a pgx tracer on its pool, as its 'claim pass round trip' is one of the scored figures", rep.Evidence.Run, list)
	}
	item("load averages (1, 5, 15 min; they count this benchmark's own runnable processes too):")
	for _, l := range rep.Load {
		sub("%s", l)
	}

	h(3, "Results (median of the runs, min – max)")
	if md {
		writeMarkdownTable(w, rep.Metrics)
	} else {
		writeTable(w, rep.Metrics)
	}

	h(3, "Targets (on medians)")
	writeTargets(w, rep.Targets, md)

	h(3, "Method notes")
	for _, sc := range scenarios {
		for _, n := range rep.Notes[sc.name] {
			item("%s: %s", sc.name, n)
		}
	}

	if len(rep.Evidence.Statements)+len(rep.Evidence.WaitEvents)+len(rep.Evidence.Profiles)+len(rep.Evidence.Figures) > 0 {
		h(3, "Evidence")
		if len(rep.Evidence.Figures) > 0 {
			item("figures of evidence run %d (instrumented; not in the medians or the targets):", rep.Evidence.Run)
			if md {
				fmt.Fprintln(w)
			}
			writeEvidenceFigures(w, rep.Evidence.Figures, md)
			if md {
				fmt.Fprintln(w)
			}
		}
		for _, s := range rep.Evidence.Statements {
			item("%s — %d statement calls in all; busiest by total time:", s.Case, s.TotalCalls)
			for _, st := range s.Top {
				sub("%d calls, %.1f ms total, %.3f ms mean, %d rows: `%s`", st.Calls, st.TotalMS, st.MeanMS, st.Rows, st.Query)
			}
		}
		for _, ws := range rep.Evidence.WaitEvents {
			item("wait events, %s (sampled every 50ms; share of samples): %s", ws.Case, ws)
		}
		for _, p := range rep.Evidence.Profiles {
			item("CPU profile: %s", p)
		}
	}
	if len(rep.Errors) > 0 {
		h(3, "ERRORS")
		for _, e := range rep.Errors {
			item("%s", e)
		}
		item("what these runs measured before they failed is left out of the table and the targets")
	}
}
