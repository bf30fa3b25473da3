package main

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgdsn"
	"github.com/bellhopq/bellhop/internal/pgtest"
	"github.com/bellhopq/bellhop/migrations"
)

var (
	demoDirRE   = regexp.MustCompile(`^PostgreSQL data in (\S+) \(removed on exit\)$`)
	demoAckedRE = regexp.MustCompile(`^\s+#\d+\s+\S+\s+attempt \d+ → 200 acked, `)
	demoDoneRE  = regexp.MustCompile(`^done: (\d+) messages? enqueued, (\d+) deliver(?:y|ies), (\d+) dead letters?`)
)

// TestDemo: `bellhop demo` without DATABASE_URL starts its own
// PostgreSQL, delivers, stops on SIGINT with status 0 and leaves neither a
// postgres process nor its temp dir behind.
func TestDemo(t *testing.T) {
	t.Parallel()
	p := start(t, nil, "demo", "--interval", "50ms") // baseEnv has no DATABASE_URL
	dir := p.waitLine(false, demoDirRE, 60*time.Second)[1]
	dataDir, err := filepath.EvalSymlinks(filepath.Join(dir, "data"))
	if err != nil {
		t.Fatalf("the demo's data dir: %v", err)
	}
	pid := postmasterPID(t, dataDir)
	if procs := serverProcs(dataDir); len(procs) == 0 {
		t.Fatalf("no postgres process runs in %s", dataDir)
	}

	// Let it run until the whole story has been told: plain acks, a
	// delayed message, a flaky one acked on its third attempt and a
	// poison one dead-lettered.
	for _, re := range []*regexp.Regexp{
		demoAckedRE,
		regexp.MustCompile(`#\d+\s+delayed\s+attempt 1 → 200 acked`),
		regexp.MustCompile(`#\d+\s+flaky\s+attempt 2 → 500, will be retried`),
		regexp.MustCompile(`#\d+\s+flaky\s+attempt 3 → 200 acked`),
		regexp.MustCompile(`#\d+\s+poison\s+attempt 1 → 400, rejected: dead-lettered`),
	} {
		p.waitLine(false, re, 30*time.Second)
	}

	p.signal(os.Interrupt)
	if code := p.wait(30 * time.Second); code != 0 {
		t.Fatalf("demo exited %d after SIGINT", code)
	}
	done := p.waitLine(false, demoDoneRE, time.Second)
	if n, _ := strconv.Atoi(done[2]); n < 10 {
		t.Errorf("demo reports %s deliveries: %q", done[2], done[0])
	}
	if n, _ := strconv.Atoi(done[3]); n < 1 {
		t.Errorf("demo reports %s dead letters: %q", done[3], done[0])
	}
	if strings.Contains(p.stderr(), "panic") {
		t.Errorf("demo stderr:\n%s", p.stderr())
	}

	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the demo left %s behind (stat: %v)", dir, err)
	}
	// The postmaster is gone: its pid is dead, or reused by a process
	// that is not running in the demo's data dir.
	if err := syscall.Kill(pid, 0); err == nil {
		if cwd, _ := os.Readlink("/proc/" + strconv.Itoa(pid) + "/cwd"); strings.HasPrefix(cwd, dataDir) {
			t.Errorf("postmaster %d still runs in %s", pid, cwd)
		}
	}
	if procs := serverProcs(dataDir); len(procs) != 0 {
		t.Errorf("postgres processes %v of the demo's cluster survived", procs)
	}
}

// TestDemoWithDatabaseURL: with DATABASE_URL, the demo replaces
// demo/orders' consumer with its own, on loopback, and its closing line
// counts this run's dead letters only. It listed the queue's dead letters,
// which stopped at the listing's default of 100 and took in earlier runs':
// here it reported 100.
func TestDemoWithDatabaseURL(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "app", "create", demoApp)
	oldID, _ := addConsumer(t, dsn, "--app", demoApp, "--queue", demoQueue, "--url", "http://127.0.0.1:9/hook")
	pool := db(t, dsn)
	const earlier = 150 // dead letters of earlier runs
	if _, err := pool.Exec(t.Context(), `
		INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error)
		SELECT gen_random_uuid(), 'queue', id, $2, jsonb_build_object('n', g, 'kind', 'poison', 'run', gen_random_uuid()),
		       now() - interval '1 day', 1, 4, 'cannot process this'
		FROM apps, generate_series(1, $3::int) AS g WHERE name = $1`, demoApp, demoQueue, earlier); err != nil {
		t.Fatal(err)
	}

	p := start(t, []string{"DATABASE_URL=" + dsn}, "demo", "--interval", "20ms")
	poisonRE := regexp.MustCompile(`#\d+\s+poison\s+attempt 1 → 400, rejected: dead-lettered`)
	p.waitLine(false, poisonRE, 60*time.Second)
	p.signal(os.Interrupt)
	if code := p.wait(30 * time.Second); code != 0 {
		t.Fatalf("demo exited %d after SIGINT:\n%s", code, p.stderr())
	}
	done := p.waitLine(false, demoDoneRE, time.Second)
	reported, _ := strconv.Atoi(done[3])
	mine := queryInt(t, pool, `SELECT count(*) FROM dead_letters d JOIN apps a ON a.id = d.app_id
		WHERE a.name = $1 AND d.queue_name = $2`, demoApp, demoQueue) - earlier
	if reported != mine || mine < 1 {
		t.Errorf("demo reports %d dead letters (%q); this run dead-lettered %d", reported, done[0], mine)
	}
	// Its last line says what became of the queue's consumer; its log
	// does not repeat, as warnings, the dead letters it printed.
	p.waitLine(false, regexp.MustCompile(`^`+regexp.QuoteMeta(demoLeftConsumer)+`$`), time.Second)
	if n := p.countErrLines(regexp.MustCompile(`dead-lettered`)); n != 0 {
		t.Errorf("%d log lines repeat the dead letters:\n%s", n, p.stderr())
	}

	// The consumer registered before the demo is gone; the demo's pushes
	// to its own loopback listener, which ended with it.
	if n := queryInt(t, pool, `SELECT count(*) FROM triggers WHERE id = $1`, oldID); n != 0 {
		t.Errorf("the consumer %s registered before the demo is still there", oldID)
	}
	c, err := bellhop.NewClient(pool).ConsumerOf(t.Context(), demoApp, demoQueue)
	if err != nil || !strings.HasPrefix(c.URL, "http://127.0.0.1:") || c.URL == "http://127.0.0.1:9/hook" {
		t.Errorf("demo/orders' consumer after the demo: %+v, %v; want the demo's, on loopback", c, err)
	}
}

// TestDemoDispatcherFails: when the demo's dispatcher cannot start, the
// demo stops enqueueing and exits 1 at once, saying so. It waited for
// Ctrl-C, enqueueing a message every interval that nothing would
// deliver, and said nothing of the error until then. Here the dispatcher
// is refused its connection: the demo's role may have one connection,
// which the demo's own pool holds.
func TestDemoDispatcherFails(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	pool := db(t, dsn)
	var owner string
	if err := pool.QueryRow(t.Context(), "SELECT current_user").Scan(&owner); err != nil {
		t.Fatal(err)
	}
	// A member of the schema's owner may use all of it, but, unlike a
	// superuser, is held to its connection limit.
	role := "bellhop_demo_" + uuid.NewString()[:8]
	if _, err := pool.Exec(t.Context(), "CREATE ROLE "+role+" LOGIN CONNECTION LIMIT 1 IN ROLE "+pgx.Identifier{owner}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { // after the demo's, registered below
		if _, err := pool.Exec(context.Background(), "DROP ROLE "+role); err != nil {
			t.Errorf("drop role %s: %v", role, err)
		}
	})
	limited, err := pgdsn.WithUser(dsn, role)
	if err != nil {
		t.Fatal(err)
	}

	p := start(t, []string{"DATABASE_URL=" + limited}, "demo", "--interval", "5ms")
	p.waitLine(false, regexp.MustCompile(`^enqueuing a message every 5ms`), 60*time.Second)
	if code := p.wait(15 * time.Second); code != 1 {
		t.Errorf("demo exited %d when its dispatcher could not connect, want 1", code)
	}
	m := p.waitLine(true, regexp.MustCompile(`^bellhop: the demo's dispatcher failed, so the demo stopped after enqueuing (\d+) messages?: dispatcher: connect: .*too many connections for role`), time.Second)
	// It enqueued nothing after the failure: the queue holds what it
	// says it enqueued (no dispatcher took any).
	queued := queryInt(t, pool, `SELECT count(*) FROM queue_messages q JOIN apps a ON a.id = q.app_id
		WHERE a.name = $1 AND q.queue_name = $2`, demoApp, demoQueue)
	if strconv.Itoa(queued) != m[1] {
		t.Errorf("demo/orders holds %d messages; the demo says it enqueued %s", queued, m[1])
	}
}

// TestDemoNotItsMessages: messages in demo/orders that this run of the
// demo did not enqueue (docker-compose's producer's, setup-demo users',
// an earlier run's) are acked and printed as not the demo's, without a
// latency, and counted apart from the run's deliveries. They were
// printed as deliveries "#0" with a latency from a send time of zero
// ("499020h36m12s after enqueue") and counted among them.
func TestDemoNotItsMessages(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "app", "create", demoApp)
	addConsumer(t, dsn, "--app", demoApp, "--queue", demoQueue, "--url", "http://127.0.0.1:9/hook")
	ids := map[string]bool{}
	for _, payload := range []string{
		`{"sent_at": "2025-06-01T12:00:00Z"}`,                                                  // docker-compose's producer
		`{"n": 3, "kind": "flaky", "run": "` + uuid.NewString() + `", "sent_at_unix_nano": 1}`, // an earlier run
		`"not an object"`,
	} {
		ids[enqueue(t, dsn, demoApp, demoQueue, payload)] = false
	}

	// At an interval of an hour the demo enqueues none of its own.
	p := start(t, []string{"DATABASE_URL=" + dsn}, "demo", "--interval", "1h")
	otherRE := regexp.MustCompile(`^  message (\S+) \(not from this demo run\) attempt 1 → 200 acked$`)
	waitFor(t, 60*time.Second, "the demo to ack the messages it did not enqueue", func() bool { return p.countLines(otherRE) >= len(ids) })
	for _, line := range strings.Split(p.stdout(), "\n") {
		if m := otherRE.FindStringSubmatch(line); m != nil {
			if seen, ok := ids[m[1]]; !ok || seen {
				t.Errorf("the demo acks %s, which is not one of %v or is acked twice", m[1], ids)
			}
			ids[m[1]] = true
		}
	}
	p.signal(os.Interrupt)
	if code := p.wait(30 * time.Second); code != 0 {
		t.Fatalf("demo exited %d after SIGINT", code)
	}
	const want = "done: 0 messages enqueued, 0 deliveries, 0 dead letters; also acked 3 messages not from this demo run"
	if done := p.waitLine(false, regexp.MustCompile(`^done: .*`), time.Second)[0]; done != want {
		t.Errorf("the demo's closing line is %q, want %q", done, want)
	}
	if n := p.countLines(regexp.MustCompile(`after enqueue|^\s+#`)); n != 0 {
		t.Errorf("the demo printed %d messages it did not enqueue as its own deliveries", n)
	}
}

// TestDemoCountsWhatWasEnqueued: the closing line's "N messages
// enqueued" counts the messages the database took, not those the demo
// tried: it counted every attempt, failed and cancelled ones too. Here
// the database refuses every third of the run's messages, and records
// those it takes.
func TestDemoCountsWhatWasEnqueued(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	pool := db(t, dsn)
	if _, err := pool.Exec(t.Context(), `
		CREATE TABLE demo_taken (n int NOT NULL);
		CREATE FUNCTION demo_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.payload ? 'run' AND (NEW.payload->>'n')::int % 3 = 0 THEN
				RAISE EXCEPTION 'refused #%', NEW.payload->>'n';
			END IF;
			RETURN NEW;
		END $$;
		CREATE FUNCTION demo_record() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			INSERT INTO demo_taken VALUES ((NEW.payload->>'n')::int);
			RETURN NULL;
		END $$;
		CREATE TRIGGER demo_refuse BEFORE INSERT ON queue_messages FOR EACH ROW EXECUTE FUNCTION demo_refuse();
		CREATE TRIGGER demo_record AFTER INSERT ON queue_messages FOR EACH ROW EXECUTE FUNCTION demo_record();`); err != nil {
		t.Fatal(err)
	}
	p := start(t, []string{"DATABASE_URL=" + dsn}, "demo", "--interval", "20ms")
	failedRE := regexp.MustCompile(`^enqueue #(\d+) failed: .*refused #`)
	// A delivery too: stopped while its dispatcher is still starting,
	// the demo stops without its closing line.
	waitFor(t, 60*time.Second, "two refused enqueues and a delivery", func() bool {
		return p.countLines(failedRE) >= 2 && p.countLines(demoAckedRE) >= 1
	})
	p.signal(os.Interrupt)
	if code := p.wait(30 * time.Second); code != 0 {
		t.Fatalf("demo exited %d after SIGINT:\n%s", code, p.stderr())
	}
	done := p.waitLine(false, demoDoneRE, time.Second)
	reported, _ := strconv.Atoi(done[1])
	taken := queryInt(t, pool, "SELECT count(*) FROM demo_taken")
	if reported != taken || taken < 2 {
		t.Errorf("the demo reports %d messages enqueued (%q); the database took %d", reported, done[0], taken)
	}
	// The #n labels stay a sequence: the refused ones keep theirs.
	if n := p.countLines(regexp.MustCompile(`^enqueue #(3|6) failed: `)); n != 2 {
		t.Errorf("%d lines for refused messages #3 and #6, want 2:\n%s", n, p.stdout())
	}
}

// TestDemoStopAnnouncedAtOnce: Ctrl-C while an enqueue is held up (a
// slow database) is answered at once, and the enqueue has demoStopWait
// left. The demo said nothing until the enqueue returned, up to its whole
// 10s timeout. Here a trigger holds the run's enqueues at an advisory lock
// the test keeps.
func TestDemoStopAnnouncedAtOnce(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	pool := db(t, dsn)
	if _, err := pool.Exec(t.Context(), `
		CREATE FUNCTION demo_gate() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.payload ? 'run' THEN
				PERFORM pg_advisory_lock_shared(4242);
				PERFORM pg_advisory_unlock_shared(4242);
			END IF;
			RETURN NEW;
		END $$;
		CREATE TRIGGER demo_gate BEFORE INSERT ON queue_messages FOR EACH ROW EXECUTE FUNCTION demo_gate();`); err != nil {
		t.Fatal(err)
	}
	p := start(t, []string{"DATABASE_URL=" + dsn}, "demo", "--interval", "20ms")
	p.waitLine(false, demoAckedRE, 60*time.Second)
	gate, err := pool.Acquire(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer gate.Release()
	if _, err := gate.Exec(t.Context(), "SELECT pg_advisory_lock(4242)"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "an enqueue held at the gate", func() bool {
		return queryInt(t, pool, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = 4242 AND NOT granted
			AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`) > 0
	})
	p.signal(os.Interrupt)
	p.waitLine(false, regexp.MustCompile(`^stopping… \(waiting up to 2s for the enqueue in progress\)$`), 5*time.Second)
	// Still held: it gives up after demoStopWait, not after the 10s
	// timeout that began before the signal.
	p.waitLine(false, regexp.MustCompile(`^enqueue #\d+ failed: `), 6*time.Second)
	if _, err := gate.Exec(t.Context(), "SELECT pg_advisory_unlock(4242)"); err != nil {
		t.Fatal(err)
	}
	if code := p.wait(30 * time.Second); code != 0 {
		t.Fatalf("demo exited %d after SIGINT:\n%s", code, p.stderr())
	}
	p.waitLine(false, demoDoneRE, time.Second)
	if n := p.countLines(regexp.MustCompile(`^stopping`)); n != 1 {
		t.Errorf("the demo said it was stopping %d times, want once:\n%s", n, p.stdout())
	}
}

// TestDemoStoppedWhileStarting: Ctrl-C while the demo starts up (here
// while it reads the schema's version, which another session has locked)
// stops it, exit 0, and says so. It used to exit without a word.
func TestDemoStoppedWhileStarting(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	pool := lockSchemaVersion(t, dsn)
	p := start(t, []string{"DATABASE_URL=" + dsn}, "demo")
	waitFor(t, 30*time.Second, "the demo waiting for the schema's version", func() bool {
		// pg_locks spans the server: another test's database, made from
		// the same template, has a version table of the same oid, and
		// its demo waiting on it let this test signal its own demo
		// before that had its handler, which the signal then killed.
		return queryInt(t, pool, `SELECT count(*) FROM pg_locks WHERE relation = $1::regclass AND NOT granted
			AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`, migrations.VersionTable) > 0
	})
	p.signal(os.Interrupt)
	if code := p.wait(30 * time.Second); code != 0 {
		t.Fatalf("demo exited %d after SIGINT while starting:\n%s", code, p.stderr())
	}
	p.waitLine(false, regexp.MustCompile(`^stopped while starting$`), time.Second)
}

// TestDemoLogLevel: the demo logs errors only, in the console format, so
// that its own story is not drowned, unless a level or a format is asked
// for: --log-level or BELLHOP_LOG_LEVEL was raised to warn all the same,
// and debug showed nothing; its dead letters, made on purpose, were each
// a JSON warning between its own lines.
func TestDemoLogLevel(t *testing.T) {
	t.Parallel()
	startedRE := regexp.MustCompile(`dispatcher started`)
	jsonRE := regexp.MustCompile(`^\{"level":`)
	tests := []struct {
		name string
		env  []string
		args []string
		info bool // the dispatcher's info lines are logged
		json bool // as JSON
	}{
		{"default", nil, nil, false, false},
		{"--log-level debug", nil, []string{"--log-level", "debug"}, true, false},
		{"--log-level info", nil, []string{"--log-level", "info"}, true, false},
		{"BELLHOP_LOG_LEVEL=DEBUG", []string{"BELLHOP_LOG_LEVEL=DEBUG"}, nil, true, false},
		{"--log-level error", nil, []string{"--log-level", "error"}, false, false},
		{"--log-level info --log-format json", nil, []string{"--log-level", "info", "--log-format", "json"}, true, true},
		{"BELLHOP_LOG_FORMAT=json --log-level warn", []string{"BELLHOP_LOG_FORMAT=json"}, []string{"--log-level", "warn"}, false, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dsn := pgtest.ConnString(t)
			p := start(t, append([]string{"DATABASE_URL=" + dsn}, tc.env...), append(tc.args, "demo", "--interval", "20ms")...)
			// The dispatcher logs "dispatcher started" before it waits
			// for the stop: by the exit, if at all.
			p.waitLine(false, demoAckedRE, 60*time.Second)
			p.signal(os.Interrupt)
			if code := p.wait(30 * time.Second); code != 0 {
				t.Fatalf("demo exited %d after SIGINT:\n%s", code, p.stderr())
			}
			if got := p.countErrLines(startedRE) > 0; got != tc.info {
				t.Errorf("dispatcher's info line logged: %t, want %t\n%s", got, tc.info, p.stderr())
			}
			// With warnings on, the demo's dead letters are logged.
			if lines, jsonLines := p.countErrLines(regexp.MustCompile(`.`)), p.countErrLines(jsonRE); lines > 0 && (jsonLines == lines) != tc.json {
				t.Errorf("%d of %d log lines are JSON, want all: %t\n%s", jsonLines, lines, tc.json, p.stderr())
			}
		})
	}
}

// TestDemoSummary: the closing line counts in the singular where a count
// is 1: it read "1 dead letters". It says where to see dead letters only
// where there are some in a database that is kept: it said so of a
// throwaway one, removed by then.
func TestDemoSummary(t *testing.T) {
	t.Parallel()
	const hint = " (see `bellhop dead ls --app demo`)"
	tests := []struct {
		n                      int
		delivered, dead, other int64
		deadErr                error
		kept                   bool
		want                   string
	}{
		{1, 1, 1, 1, nil, true, "done: 1 message enqueued, 1 delivery, 1 dead letter" + hint + "; also acked 1 message not from this demo run"},
		{2, 3, 2, 0, nil, true, "done: 2 messages enqueued, 3 deliveries, 2 dead letters" + hint},
		{2, 3, 2, 0, nil, false, "done: 2 messages enqueued, 3 deliveries, 2 dead letters"},
		{0, 0, 0, 2, nil, true, "done: 0 messages enqueued, 0 deliveries, 0 dead letters; also acked 2 messages not from this demo run"},
		{1, 1, 0, 0, errors.New("boom"), true, "done: 1 message enqueued, 1 delivery; counting the dead letters failed: boom"},
	}
	for _, tc := range tests {
		if got := demoSummary(tc.n, tc.delivered, tc.dead, tc.deadErr, tc.other, tc.kept); got != tc.want {
			t.Errorf("demoSummary(%d, %d, %d, %v, %d, %t) = %q, want %q", tc.n, tc.delivered, tc.dead, tc.deadErr, tc.other, tc.kept, got, tc.want)
		}
	}
}

// TestReadmeDemoLeftovers: where the README lists what the demo leaves in
// a database given by DATABASE_URL, it says that the demo's consumer
// replaced the queue's (TestDemoWithDatabaseURL shows that it does), which
// setup-demo and docker-compose register on the same app and queue.
func TestReadmeDemoLeftovers(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	text := strings.Join(strings.Fields(string(b)), " ")
	_, leftovers, found := strings.Cut(text, "With `DATABASE_URL` set, what it wrote stays in that database")
	if !found {
		t.Fatal("README.md does not say what the demo leaves in a database given by DATABASE_URL")
	}
	leftovers, _, _ = strings.Cut(leftovers, "The tests need no setup")
	for _, want := range []string{"replaces whatever consumer `demo`/`orders` had", "`setup-demo`", "docker-compose", "loopback"} {
		if !strings.Contains(leftovers, want) {
			t.Errorf("the README's account of what the demo leaves behind (%q) does not say %q", strings.TrimSpace(leftovers), want)
		}
	}
}

// postmasterPID reads the first line of dataDir/postmaster.pid.
func postmasterPID(t *testing.T, dataDir string) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dataDir, "postmaster.pid"))
	if err != nil {
		t.Fatalf("postmaster.pid: %v", err)
	}
	line, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil || pid <= 0 {
		t.Fatalf("postmaster.pid starts with %q", line)
	}
	return pid
}

// serverProcs lists live processes whose working directory is dataDir
// (postgres and its children chdir there), also once the dir is deleted.
// Only this cluster's processes match: other tests' clusters have their
// own dirs.
func serverProcs(dataDir string) []int {
	var pids []int
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cwd, err := os.Readlink("/proc/" + e.Name() + "/cwd")
		if err != nil || (cwd != dataDir && cwd != dataDir+" (deleted)") {
			continue
		}
		st, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		s := string(st)
		if f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:]); len(f) > 0 && f[0] == "Z" {
			continue // a zombie holds nothing
		}
		pids = append(pids, pid)
	}
	return pids
}
