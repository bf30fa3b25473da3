package main

// End-to-end tests of the bellhop command: TestMain builds the real binary
// once, and the tests run it as a subprocess against real PostgreSQL (each
// test gets its own database from internal/pgtest).

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/pgdsn"
	"github.com/bellhopq/bellhop/internal/pgtest"
	"github.com/bellhopq/bellhop/migrations"
)

// binary is the bellhop executable under test, built by TestMain.
var binary string

func TestMain(m *testing.M) {
	path, err := buildBinary()
	if err != nil {
		fmt.Fprintf(os.Stderr, "build bellhop: %v\n", err)
		os.Exit(1)
	}
	binary = path
	pgtest.Main(m)
}

// buildBinary builds ./ into a fresh temp dir, with -race when the tests
// themselves run with it. pgtest.Main exits the process, so the dir cannot
// be removed by a defer: it is locked for the life of this process instead
// and swept by a later run once unlocked, as pgcluster does with its dirs.
func buildBinary() (string, error) {
	sweepBuildDirs()
	dir, err := os.MkdirTemp("", "bellhop-clitest-")
	if err != nil {
		return "", err
	}
	lock, err := os.Create(filepath.Join(dir, "lock.new"))
	if err == nil {
		err = syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
	}
	if err == nil {
		// Renamed only once locked, so a concurrent sweep never sees it unlocked.
		err = os.Rename(lock.Name(), filepath.Join(dir, "lock"))
	}
	if err != nil {
		os.RemoveAll(dir)
		return "", err
	}
	lockFile = lock // stays open, and locked, until the process exits

	out := filepath.Join(dir, "bellhop")
	if err := goBuild(out); err != nil {
		os.RemoveAll(dir)
		return "", err
	}
	return out, nil
}

// goBuild builds ./ to out, with -race when the tests themselves run with
// it (so that the packages built for them are reused) and flags.
func goBuild(out string, flags ...string) error {
	// go test puts its own GOROOT/bin first in the test's PATH.
	goTool, err := exec.LookPath("go")
	if err != nil {
		return fmt.Errorf("find the go command to build bellhop: %w", err)
	}
	args := append([]string{"build", "-o", out}, flags...)
	if raceEnabled {
		args = append(args, "-race")
	}
	cmd := exec.Command(goTool, append(args, ".")...)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	return cmd.Run()
}

var lockFile *os.File

func sweepBuildDirs() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), "bellhop-clitest-*"))
	for _, dir := range dirs {
		f, err := os.Open(filepath.Join(dir, "lock"))
		if err != nil {
			continue // being created, or not ours
		}
		if syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) == nil {
			os.RemoveAll(dir)
		}
		f.Close()
	}
}

// baseEnv is the environment of every subprocess: ours without
// DATABASE_URL and BELLHOP_* (a developer's settings must not leak into
// the tests), plus extra.
func baseEnv(extra ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "DATABASE_URL=") || strings.HasPrefix(kv, envPrefix) {
			continue
		}
		env = append(env, kv)
	}
	// The race detector sleeps a second at exit by default; the stop
	// timings measured here should be the program's own.
	env = append(env, "GORACE=atexit_sleep_ms=0")
	return append(env, extra...)
}

// raceReport fails t if a race-enabled subprocess reported a data race.
func raceReport(t *testing.T, stderr string) {
	t.Helper()
	if strings.Contains(stderr, "WARNING: DATA RACE") {
		t.Errorf("the bellhop process reported a data race:\n%s", stderr)
	}
}

// result is a finished CLI run.
type result struct {
	code           int
	stdout, stderr string
}

func (r result) String() string {
	return fmt.Sprintf("exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
}

// exe runs the binary with DATABASE_URL=dsn ("" for none) to completion.
func exe(t *testing.T, dsn, stdin string, args ...string) result {
	t.Helper()
	var env []string
	if dsn != "" {
		env = append(env, "DATABASE_URL="+dsn)
	}
	return exeEnv(t, env, stdin, args...)
}

func exeEnv(t *testing.T, env []string, stdin string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, args...)
	cmd.Env = baseEnv(env...)
	cmd.Stdin = strings.NewReader(stdin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	r := result{stdout: out.String(), stderr: errb.String()}
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
		r.code = ee.ExitCode()
	default:
		t.Fatalf("bellhop %s: %v", strings.Join(args, " "), err)
	}
	if ctx.Err() != nil {
		t.Fatalf("bellhop %s: did not finish within 60s\n%s", strings.Join(args, " "), r)
	}
	raceReport(t, r.stderr)
	return r
}

// ok runs the CLI and fails the test unless it exits 0; it returns stdout.
func ok(t *testing.T, dsn string, args ...string) string {
	t.Helper()
	r := exe(t, dsn, "", args...)
	if r.code != 0 {
		t.Fatalf("bellhop %s: %s", strings.Join(args, " "), r)
	}
	return r.stdout
}

// proc is a long-running bellhop subprocess whose output is collected
// line by line, so tests can wait for a line.
type proc struct {
	t    *testing.T
	cmd  *exec.Cmd
	mu   sync.Mutex
	cond *sync.Cond
	out  []string // stdout lines
	errs []string // stderr lines
	done chan struct{}
	code int
}

func start(t *testing.T, env []string, args ...string) *proc {
	t.Helper()
	return startCmd(t, env, exec.Command(binary, args...))
}

// startCmd is start for a command of the caller's (the binary run through
// a shell, say), with the same environment.
func startCmd(t *testing.T, env []string, cmd *exec.Cmd) *proc {
	t.Helper()
	args := cmd.Args[1:]
	cmd.Env = baseEnv(env...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	p := &proc{t: t, cmd: cmd, done: make(chan struct{})}
	p.cond = sync.NewCond(&p.mu)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var readers sync.WaitGroup
	read := func(r io.Reader, lines *[]string) {
		sc := bufio.NewScanner(r)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			p.mu.Lock()
			*lines = append(*lines, sc.Text())
			p.cond.Broadcast()
			p.mu.Unlock()
		}
	}
	readers.Go(func() { read(stdout, &p.out) })
	readers.Go(func() { read(stderr, &p.errs) })
	go func() {
		readers.Wait() // Wait must follow the reads of the pipes
		err := cmd.Wait()
		var ee *exec.ExitError
		p.mu.Lock()
		switch {
		case err == nil:
		case errors.As(err, &ee):
			p.code = ee.ExitCode()
			if st, ok := ee.Sys().(syscall.WaitStatus); ok && st.Signaled() {
				p.code = 128 + int(st.Signal())
			}
		default:
			p.code = -1
		}
		close(p.done) // under the lock, so waitLine sees it when woken
		p.cond.Broadcast()
		p.mu.Unlock()
	}()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = cmd.Process.Kill()
			<-p.done
		}
		raceReport(t, p.stderr())
		if t.Failed() {
			t.Logf("%s output:\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), p.stdout(), p.stderr())
		}
	})
	return p
}

func (p *proc) stdout() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return strings.Join(p.out, "\n")
}

func (p *proc) stderr() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return strings.Join(p.errs, "\n")
}

// waitLine waits until a line of stdout (or stderr) matching re appears
// and returns its submatches; it fails the test at the deadline or when
// the process exits without printing one.
func (p *proc) waitLine(stderr bool, re *regexp.Regexp, timeout time.Duration) []string {
	p.t.Helper()
	deadline := time.Now().Add(timeout)
	timer := time.AfterFunc(timeout, func() {
		p.mu.Lock()
		p.cond.Broadcast()
		p.mu.Unlock()
	})
	defer timer.Stop()
	match, exited := func() ([]string, bool) {
		p.mu.Lock()
		defer p.mu.Unlock()
		for seen := 0; ; {
			lines := p.out
			if stderr {
				lines = p.errs
			}
			for ; seen < len(lines); seen++ {
				if m := re.FindStringSubmatch(lines[seen]); m != nil {
					return m, false
				}
			}
			select {
			case <-p.done:
				return nil, true
			default:
			}
			if time.Now().After(deadline) {
				return nil, false
			}
			p.cond.Wait()
		}
	}()
	if match == nil {
		p.t.Fatalf("no line matching %q within %s (process exited: %t)", re, timeout, exited)
	}
	return match
}

// countLines returns how many stdout lines match re.
func (p *proc) countLines(re *regexp.Regexp) int { return p.count(false, re) }

// countErrLines returns how many stderr lines match re.
func (p *proc) countErrLines(re *regexp.Regexp) int { return p.count(true, re) }

func (p *proc) count(stderr bool, re *regexp.Regexp) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	lines := p.out
	if stderr {
		lines = p.errs
	}
	n := 0
	for _, l := range lines {
		if re.MatchString(l) {
			n++
		}
	}
	return n
}

func (p *proc) signal(sig os.Signal) {
	p.t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		p.t.Fatalf("signal %v: %v", sig, err)
	}
}

// wait waits for the process to exit and returns its exit code (128+n if
// killed by signal n).
func (p *proc) wait(timeout time.Duration) int {
	p.t.Helper()
	select {
	case <-p.done:
		return p.code
	case <-time.After(timeout):
		p.t.Fatalf("process did not exit within %s", timeout)
		return 0
	}
}

// daemon is a running `bellhop run`.
type daemon struct {
	*proc
	addr string // of /metrics, /healthz, /readyz
}

var servingRE = regexp.MustCompile(`"http_addr":"([^"]+)".*serving /metrics`)

// startDaemon runs `bellhop run` on dsn with an OS-chosen HTTP port (read
// back from its log) and waits until /readyz answers 200.
func startDaemon(t *testing.T, dsn string, args ...string) *daemon {
	t.Helper()
	p := start(t, []string{"DATABASE_URL=" + dsn}, append([]string{"run", "--http-addr", "127.0.0.1:0"}, args...)...)
	m := p.waitLine(true, servingRE, 30*time.Second)
	d := &daemon{proc: p, addr: m[1]}
	waitFor(t, 30*time.Second, "daemon ready", func() bool {
		code, _ := d.get(t, "/readyz")
		return code == http.StatusOK
	})
	return d
}

func (d *daemon) get(t *testing.T, path string) (int, string) {
	t.Helper()
	client := http.Client{Timeout: 5 * time.Second}
	resp, err := client.Get("http://" + d.addr + path)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// waitFor polls cond every 20ms until it holds, failing at the deadline.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// delivery is one request received by a hook server.
type delivery struct {
	at     time.Time
	header http.Header
	body   []byte
	verify error // bellhop.VerifyPush with the consumer's secret
}

func (d delivery) id() string { return d.header.Get(bellhop.HeaderMessageID) }

// hook is an HTTP push consumer for tests. Its respond function decides
// each response; it runs with the hook's lock released.
type hook struct {
	srv     *httptest.Server
	mu      sync.Mutex
	cond    *sync.Cond
	secret  string
	got     []delivery
	respond func(w http.ResponseWriter, r *http.Request, d delivery, nth int) // nth: deliveries of this message id so far, from 1
}

func newHook(t *testing.T) *hook {
	h := &hook{}
	h.cond = sync.NewCond(&h.mu)
	h.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		h.mu.Lock()
		d := delivery{at: time.Now(), header: r.Header.Clone(), body: body,
			verify: bellhop.VerifyPush(h.secret, r.Header, body, time.Now(), time.Minute)}
		nth := 1
		for _, o := range h.got {
			if o.id() == d.id() {
				nth++
			}
		}
		h.got = append(h.got, d)
		respond := h.respond
		h.cond.Broadcast()
		h.mu.Unlock()
		if respond != nil {
			respond(w, r, d, nth)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	t.Cleanup(h.srv.Close)
	return h
}

func (h *hook) setSecret(s string) {
	h.mu.Lock()
	h.secret = s
	h.mu.Unlock()
}

func (h *hook) deliveries() []delivery {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]delivery(nil), h.got...)
}

// waitCount waits until the hook has received at least n requests.
func (h *hook) waitCount(t *testing.T, n int, timeout time.Duration) []delivery {
	t.Helper()
	timer := time.AfterFunc(timeout, func() {
		h.mu.Lock()
		h.cond.Broadcast()
		h.mu.Unlock()
	})
	defer timer.Stop()
	deadline := time.Now().Add(timeout)
	h.mu.Lock()
	defer h.mu.Unlock()
	for len(h.got) < n {
		if time.Now().After(deadline) {
			t.Fatalf("hook got %d requests, want %d within %s", len(h.got), n, timeout)
		}
		h.cond.Wait()
	}
	return append([]delivery(nil), h.got...)
}

var (
	appCreatedRE  = regexp.MustCompile(`^app (\S+) created: id ([0-9a-f-]{36})\ndefault principal: id ([0-9a-f-]{36})$`)
	consumerRE    = regexp.MustCompile(`(?m)^consumer ([0-9a-f-]{36}) registered for (\S+)/(\S+)$`)
	secretRE      = regexp.MustCompile(`(?m)^signing secret \(shown only now\): ([0-9a-f]{64})$`)
	uuidLineRE    = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)
	enqueuedManyR = regexp.MustCompile(`^enqueued (\d+) messages$`)
)

// addConsumer runs `consumer add` and returns the printed id and secret.
func addConsumer(t *testing.T, dsn string, args ...string) (id, secret string) {
	t.Helper()
	out := ok(t, dsn, append([]string{"consumer", "add"}, args...)...)
	m := consumerRE.FindStringSubmatch(out)
	s := secretRE.FindStringSubmatch(out)
	if m == nil || s == nil {
		t.Fatalf("consumer add printed no id or secret:\n%s", out)
	}
	return m[1], s[1]
}

// enqueue runs `enqueue` with one JSON argument and returns the printed id.
func enqueue(t *testing.T, dsn, app, queue, payload string, flags ...string) string {
	t.Helper()
	out := strings.TrimSpace(ok(t, dsn, append(append([]string{"enqueue", "--app", app, "--queue", queue}, flags...), payload)...))
	if !uuidLineRE.MatchString(out) {
		t.Fatalf("enqueue printed %q, want a message id", out)
	}
	return out
}

// db opens a pool on dsn for the test's own checks.
func db(t *testing.T, dsn string) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// shopWithDeadLetters makes a database with an app shop whose queue
// orders has n dead letters, and returns its connection string and a
// pool on it.
func shopWithDeadLetters(t *testing.T, n int) (dsn string, pool *pgxpool.Pool) {
	t.Helper()
	dsn = pgtest.ConnString(t)
	ok(t, dsn, "app", "create", "shop")
	pool = db(t, dsn)
	if _, err := pool.Exec(t.Context(), `
		INSERT INTO dead_letters (id, source, app_id, queue_name, payload, enqueued_at, attempt, max_attempts, last_error)
		SELECT gen_random_uuid(), 'queue', id, 'orders', jsonb_build_object('n', g), now(), 3, 3, 'boom'
		FROM apps, generate_series(1, $1::int) AS g WHERE name = 'shop'`, n); err != nil {
		t.Fatal(err)
	}
	return dsn, pool
}

func queryInt(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// emptyDatabase creates a database without the schema (for migrate) and
// returns its DSN; it is dropped when the test ends.
func emptyDatabase(t *testing.T) string {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, pgtest.AdminConnString())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	name := fmt.Sprintf("bellhop_cli_%d", time.Now().UnixNano())
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c, err := pgx.Connect(context.Background(), pgtest.AdminConnString())
		if err != nil {
			t.Errorf("drop %s: %v", name, err)
			return
		}
		defer c.Close(context.Background())
		if _, err := c.Exec(context.Background(), "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
			t.Errorf("drop %s: %v", name, err)
		}
	})
	dsn, err := pgdsn.WithDatabase(pgtest.AdminConnString(), name)
	if err != nil {
		t.Fatal(err)
	}
	return dsn
}

// jsonEqual compares two JSON texts as values (jsonb re-spaces payloads).
func jsonEqual(t *testing.T, a, b []byte) bool {
	t.Helper()
	var x, y any
	if err := json.Unmarshal(a, &x); err != nil {
		t.Fatalf("not JSON: %q", a)
	}
	if err := json.Unmarshal(b, &y); err != nil {
		t.Fatalf("not JSON: %q", b)
	}
	xb, _ := json.Marshal(x)
	yb, _ := json.Marshal(y)
	return bytes.Equal(xb, yb)
}

// setup makes a migrated database with app "shop" and a push consumer of
// shop/orders pointing at a new hook, and returns them.
func setup(t *testing.T, consumerFlags ...string) (dsn string, h *hook, consumerID string) {
	t.Helper()
	dsn = pgtest.ConnString(t)
	ok(t, dsn, "app", "create", "shop")
	h = newHook(t)
	id, secret := addConsumer(t, dsn, append([]string{"--app", "shop", "--queue", "orders", "--url", h.srv.URL + "/hook"}, consumerFlags...)...)
	h.setSecret(secret)
	return dsn, h, id
}

// lockSchemaVersion holds the schema's version table locked, as a
// migration under way does, until the test ends, and returns the pool of
// the session that holds it (one more connection of it is free).
func lockSchemaVersion(t *testing.T, dsn string) *pgxpool.Pool {
	t.Helper()
	pool := db(t, dsn)
	tx, err := pool.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tx.Rollback(context.Background()) })
	if _, err := tx.Exec(t.Context(), "LOCK TABLE "+migrations.VersionTable+" IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	return pool
}
