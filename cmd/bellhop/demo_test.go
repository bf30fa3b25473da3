package main

import (
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgtest"
)

var (
	demoDirRE   = regexp.MustCompile(`^PostgreSQL data in (\S+) \(removed on exit\)$`)
	demoAckedRE = regexp.MustCompile(`^\s+#\d+\s+\S+\s+attempt \d+ → 200 acked, `)
	demoDoneRE  = regexp.MustCompile(`^done: (\d+) messages enqueued, (\d+) deliveries, (\d+) dead letters`)
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
