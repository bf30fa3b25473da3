package integration

// Helpers for the tests that run the real `bellhop` binary against a
// PostgreSQL cluster of their own (chaos_test.go, secrets_test.go): build
// the binary, start a TCP cluster, run CLI commands and `bellhop run`
// daemons, and read their /readyz and /metrics.

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bellhopq/bellhop/internal/pgcluster"
)

// buildBellhop builds cmd/bellhop into a temp dir and returns the
// binary's path. With race, the binary has the race detector too.
func buildBellhop(t *testing.T, race bool) string {
	t.Helper()
	// go test puts its own GOROOT/bin first in the test's PATH.
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("find the go command to build bellhop: %v", err)
	}
	out := filepath.Join(t.TempDir(), "bellhop")
	args := []string{"build", "-o", out}
	if race {
		args = append(args, "-race")
	}
	args = append(args, "../cmd/bellhop")
	cmd := exec.Command(goBin, args...)
	var buf bytes.Buffer
	cmd.Stdout, cmd.Stderr = &buf, &buf
	start := time.Now()
	if err := cmd.Run(); err != nil {
		t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, buf.String())
	}
	t.Logf("built %s (race %t) in %s", out, race, time.Since(start).Round(time.Millisecond))
	return out
}

// ownCluster starts a throwaway cluster listening on TCP, for a test that
// restarts, freezes or reconfigures it (the package's shared cluster must
// not be touched), with a database "bellhop" created in it. fsync=off: the
// tests crash the server process, never the machine, so the page cache
// keeps everything written, and without fsync the 2-core CI machine stays
// fast; what synchronous_commit=off loses on a crash (the dispatcher's
// last commits, not yet written to the OS) is still lost.
func ownCluster(t *testing.T, settings map[string]string) *pgcluster.Cluster {
	t.Helper()
	s := map[string]string{"fsync": "off"}
	for k, v := range settings {
		s[k] = v
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, err := pgcluster.Start(ctx, pgcluster.Options{TCP: true, Settings: s})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Stop(); err != nil {
			t.Errorf("stop cluster: %v", err)
		}
	})
	conn, err := pgx.Connect(ctx, c.ConnString("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "CREATE DATABASE bellhop"); err != nil {
		t.Fatal(err)
	}
	return c
}

// childEnv is the environment for bellhop child processes: ours, without
// any DATABASE_URL or BELLHOP_ setting that could change their
// configuration behind the test's back, plus extra.
func childEnv(extra ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "DATABASE_URL=") || strings.HasPrefix(kv, "BELLHOP_") {
			continue
		}
		env = append(env, kv)
	}
	return append(env, extra...)
}

// cliResult is one finished CLI command.
type cliResult struct {
	stdout, stderr string
	err            error
}

// runCLI runs one bellhop command to completion with DATABASE_URL=dsn.
func runCLI(bin, dsn string, args ...string) cliResult {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = childEnv("DATABASE_URL=" + dsn)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	return cliResult{stdout: out.String(), stderr: errb.String(), err: err}
}

// mustCLI is runCLI that fails t on a non-zero exit.
func mustCLI(t *testing.T, bin, dsn string, args ...string) cliResult {
	t.Helper()
	r := runCLI(bin, dsn, args...)
	if r.err != nil {
		t.Fatalf("bellhop %s: %v\nstdout: %s\nstderr: %s", strings.Join(args, " "), r.err, r.stdout, r.stderr)
	}
	return r
}

// servingRE finds, in a daemon's log, the address its HTTP server
// listens on.
var servingRE = regexp.MustCompile(`"http_addr":"([^"]+)".*serving /metrics`)

// daemon is one `bellhop run` process, restartable after a kill. Its
// stdout and stderr, across restarts, are appended to one log file.
//
// Each process listens on a port the kernel picks, read back from its own
// part of the log: a port picked by the test and freed for the daemon to
// bind could be taken in between, by any socket of the run.
type daemon struct {
	name, bin string
	env, args []string
	logPath   string

	mu      sync.Mutex
	cmd     *exec.Cmd
	logFrom int64         // the log's size when the current process started
	addr    string        // the current process's HTTP address, once read
	done    chan struct{} // closed when the current process has been reaped
	killed  bool          // the current process is being killed on purpose
	exitErr error         // the current process's exit, once done
	// unexpected lists exits that nobody asked for (a crash).
	unexpected []string
}

func newDaemon(t *testing.T, name, bin, dsn string, extraArgs ...string) *daemon {
	d := &daemon{
		name: name, bin: bin,
		env:     childEnv("DATABASE_URL=" + dsn),
		logPath: filepath.Join(t.TempDir(), name+".log"),
	}
	d.args = append([]string{"run", "--http-addr", "127.0.0.1:0"}, extraArgs...)
	return d
}

// httpAddr is the current process's HTTP address, or "" until it has
// logged it.
func (d *daemon) httpAddr() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.addr != "" || d.cmd == nil {
		return d.addr
	}
	f, err := os.Open(d.logPath)
	if err != nil {
		return ""
	}
	defer f.Close()
	if _, err := f.Seek(d.logFrom, io.SeekStart); err != nil {
		return ""
	}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		if m := servingRE.FindStringSubmatch(sc.Text()); m != nil {
			d.addr = m[1]
			break
		}
	}
	return d.addr
}

// get sends a GET for path to the current process's HTTP server.
func (d *daemon) get(path string) (*http.Response, error) {
	addr := d.httpAddr()
	if addr == "" {
		return nil, fmt.Errorf("%s: no HTTP address in its log yet", d.name)
	}
	return probeClient.Get("http://" + addr + path)
}

// start runs a new process; the previous one, if any, must have exited.
func (d *daemon) start() error {
	f, err := os.OpenFile(d.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return err
	}
	cmd := exec.Command(d.bin, d.args...)
	cmd.Env = d.env
	cmd.Stdout, cmd.Stderr = f, f
	// Die with the test process, whatever kills it (see startPinned).
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := startPinned(cmd); err != nil {
		f.Close()
		return err
	}
	done := make(chan struct{})
	d.mu.Lock()
	d.cmd, d.done, d.killed, d.exitErr = cmd, done, false, nil
	d.logFrom, d.addr = st.Size(), ""
	d.mu.Unlock()
	go func() {
		err := cmd.Wait()
		f.Close()
		d.mu.Lock()
		d.exitErr = err
		if !d.killed {
			d.unexpected = append(d.unexpected, fmt.Sprintf("pid %d exited on its own: %v", cmd.Process.Pid, err))
		}
		d.mu.Unlock()
		close(done)
	}()
	return nil
}

// pid is the current process's pid.
func (d *daemon) pid() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.cmd.Process.Pid
}

// signal sends sig to the current process and, unless it is SIGCONT or 0,
// marks the coming exit as expected.
func (d *daemon) signal(sig syscall.Signal) error {
	d.mu.Lock()
	cmd := d.cmd
	if sig != 0 && sig != syscall.SIGCONT {
		d.killed = true
	}
	d.mu.Unlock()
	return cmd.Process.Signal(sig)
}

// wait waits up to timeout for the current process to exit.
func (d *daemon) wait(timeout time.Duration) (exited bool, err error) {
	d.mu.Lock()
	done := d.done
	d.mu.Unlock()
	select {
	case <-done:
		d.mu.Lock()
		defer d.mu.Unlock()
		return true, d.exitErr
	case <-time.After(timeout):
		return false, nil
	}
}

// kill9 SIGKILLs the current process and waits until it is reaped.
func (d *daemon) kill9() error {
	if err := d.signal(syscall.SIGKILL); err != nil {
		return err
	}
	if exited, _ := d.wait(10 * time.Second); !exited {
		return fmt.Errorf("%s: not reaped 10s after SIGKILL", d.name)
	}
	return nil
}

// stop stops the process gracefully (SIGTERM), killing it after timeout.
// It returns the exit error of a graceful stop (nil: exit status 0).
func (d *daemon) stop(timeout time.Duration) error {
	d.mu.Lock()
	started := d.cmd != nil
	d.mu.Unlock()
	if !started {
		return nil
	}
	if exited, err := d.wait(0); exited {
		return err
	}
	_ = d.signal(syscall.SIGTERM)
	if exited, err := d.wait(timeout); exited {
		return err
	}
	_ = d.kill9()
	return fmt.Errorf("%s: still running %s after SIGTERM; killed", d.name, timeout)
}

func (d *daemon) unexpectedExits() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]string(nil), d.unexpected...)
}

// logTail returns the last n lines of the daemon's log.
func (d *daemon) logTail(n int) string {
	b, _ := os.ReadFile(d.logPath)
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

var probeClient = &http.Client{Timeout: 3 * time.Second}

// ready reports whether /readyz answers 200.
func (d *daemon) ready() bool {
	resp, err := d.get("/readyz")
	if err != nil {
		return false
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// scrape returns the /metrics text.
func (d *daemon) scrape() (string, error) {
	resp, err := d.get("/metrics")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("/metrics: HTTP %d", resp.StatusCode)
	}
	return string(b), nil
}

// metric reads one unlabelled sample from /metrics text; ok is false if it
// is absent.
func metric(text, name string) (v float64, ok bool) {
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if rest, found := strings.CutPrefix(line, name+" "); found {
			f, err := strconv.ParseFloat(strings.TrimSpace(rest), 64)
			if err == nil {
				return f, true
			}
		}
	}
	return 0, false
}

// Pdeathsig fires when the thread that forked the child exits, not the
// process, and Go may retire threads. So children are forked from one
// goroutine locked to its thread for good (as pgcluster does), which makes
// "the thread exits" mean "the test process exits".
var (
	pinnedOnce sync.Once
	pinnedReqs chan pinnedReq
)

type pinnedReq struct {
	cmd  *exec.Cmd
	errc chan error
}

func startPinned(cmd *exec.Cmd) error {
	pinnedOnce.Do(func() {
		pinnedReqs = make(chan pinnedReq)
		go func() {
			runtime.LockOSThread() // never unlocked
			for r := range pinnedReqs {
				r.errc <- r.cmd.Start()
			}
		}()
	})
	errc := make(chan error, 1)
	pinnedReqs <- pinnedReq{cmd: cmd, errc: errc}
	return <-errc
}
