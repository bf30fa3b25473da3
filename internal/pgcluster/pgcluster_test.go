package pgcluster

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

func testSettings() map[string]string {
	return map[string]string{"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
}

func mustQueryInt(t *testing.T, dsn, sql string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatalf("connect %q: %v", dsn, err)
	}
	defer conn.Close(context.Background())
	var n int
	if err := conn.QueryRow(ctx, sql).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// stillAlive returns those of pids that are live (non-zombie) processes.
// Zombies are ignored: PID 1 in some containers never reaps orphans, and a
// zombie holds no socket, memory or files.
func stillAlive(pids ...int) []int {
	var live []int
	for _, pid := range pids {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		s := string(b)
		if f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:]); len(f) > 0 && f[0] != "Z" {
			live = append(live, pid)
		}
	}
	return live
}

func TestFindBinDir(t *testing.T) {
	dir, err := FindBinDir()
	if err != nil {
		t.Fatal(err)
	}
	if !hasServerBinaries(dir) {
		t.Fatalf("FindBinDir() = %q, which lacks initdb/postgres", dir)
	}
	t.Logf("bin dir: %s", dir)
}

func TestLifecycle(t *testing.T) {
	ctx := context.Background()
	t0 := time.Now()
	c, err := Start(ctx, Options{TCP: true, Settings: testSettings()})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	t.Logf("start: %v (dir %s, port %d)", time.Since(t0), c.Dir(), c.Port())

	if got := mustQueryInt(t, c.ConnString("postgres"), "SELECT 1"); got != 1 {
		t.Fatalf("unix socket query = %d", got)
	}
	if got := mustQueryInt(t, c.TCPConnString("postgres"), "SELECT 1"); got != 1 {
		t.Fatalf("TCP query = %d", got)
	}
	if got := mustQueryInt(t, c.ConnString("postgres"), "SELECT current_setting('max_connections')::int"); got != 300 {
		t.Fatalf("max_connections = %d, want 300", got)
	}
	if got := mustQueryInt(t, c.ConnString("postgres"), "SELECT (current_setting('fsync') = 'off')::int"); got != 1 {
		t.Fatal("Settings not applied: fsync is on")
	}
	if _, err := os.Stat(filepath.Join(c.Dir(), "server.log")); err != nil {
		t.Fatalf("server.log: %v", err)
	}
	SweepStale(filepath.Join(filepath.Dir(c.Dir()), "bellhop-pg*"), "server.log")
	if _, err := os.Stat(c.Dir()); err != nil {
		t.Fatalf("sweepStale removed a live cluster's dir: %v", err)
	}
	func() {
		conn, err := pgx.Connect(ctx, c.ConnString("postgres"))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "CREATE TABLE survives (n int); INSERT INTO survives VALUES (42)"); err != nil {
			t.Fatal(err)
		}
	}()

	for _, mode := range []string{"fast", "immediate"} {
		before := c.PID()
		t0 := time.Now()
		if err := c.Restart(ctx, mode); err != nil {
			t.Fatalf("Restart(%q): %v", mode, err)
		}
		t.Logf("restart %s: %v", mode, time.Since(t0))
		if after := c.PID(); after == before || after == 0 {
			t.Fatalf("Restart(%q): pid %d -> %d", mode, before, after)
		}
		if got := mustQueryInt(t, c.ConnString("postgres"), "SELECT n FROM survives"); got != 42 {
			t.Fatalf("after Restart(%q): n = %d", mode, got)
		}
		if got := mustQueryInt(t, c.TCPConnString("postgres"), "SELECT 1"); got != 1 {
			t.Fatalf("after Restart(%q): TCP query = %d", mode, got)
		}
	}
	if err := c.Restart(ctx, "smart"); err == nil {
		t.Fatal("Restart(\"smart\") succeeded, want error")
	}

	t.Run("freeze", func(t *testing.T) {
		conn, err := pgx.Connect(ctx, c.ConnString("postgres"))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		if err := c.Signal(syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		thawed := false
		defer func() {
			if !thawed {
				_ = c.Signal(syscall.SIGCONT)
			}
		}()
		short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		var one int
		err = conn.QueryRow(short, "SELECT 1").Scan(&one)
		cancel()
		if err == nil {
			t.Fatal("query on an established connection succeeded while the server was frozen")
		}
		short, cancel = context.WithTimeout(ctx, 300*time.Millisecond)
		c2, err := pgx.Connect(short, c.ConnString("postgres"))
		cancel()
		if err == nil {
			c2.Close(ctx)
			t.Fatal("connect succeeded while the server was frozen")
		}
		if err := c.Signal(syscall.SIGCONT); err != nil {
			t.Fatal(err)
		}
		thawed = true
		if got := mustQueryInt(t, c.ConnString("postgres"), "SELECT 1"); got != 1 {
			t.Fatalf("after SIGCONT: %d", got)
		}
	})

	t.Run("restart after crash", func(t *testing.T) {
		if err := c.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		if err := c.Restart(ctx, "fast"); err != nil {
			t.Fatal(err)
		}
		if got := mustQueryInt(t, c.ConnString("postgres"), "SELECT n FROM survives"); got != 42 {
			t.Fatalf("n = %d", got)
		}
	})

	t.Run("restart after postmaster-only kill", func(t *testing.T) {
		// Its children are orphaned and must be gone before a new
		// postmaster can take the shared memory.
		if err := syscall.Kill(c.PID(), syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		if err := c.Restart(ctx, "immediate"); err != nil {
			t.Fatal(err)
		}
		if got := mustQueryInt(t, c.ConnString("postgres"), "SELECT n FROM survives"); got != 42 {
			t.Fatalf("n = %d", got)
		}
	})

	t.Run("restart while frozen", func(t *testing.T) {
		if err := c.Signal(syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		t0 := time.Now()
		if err := c.Restart(ctx, "fast"); err != nil {
			t.Fatal(err)
		}
		t.Logf("restart of a frozen server: %v", time.Since(t0))
		mustQueryInt(t, c.ConnString("postgres"), "SELECT 1")
	})

	pid, dir := c.PID(), c.Dir()
	procs := serverProcs(c.dataDir)
	if len(procs) < 2 {
		t.Fatalf("serverProcs found %v, want the postmaster and its children (checkpointer etc.)", procs)
	}
	t0 = time.Now()
	if err := c.Stop(); err != nil {
		t.Fatal(err)
	}
	t.Logf("stop: %v", time.Since(t0))
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("dir %s still there after Stop (stat: %v)", dir, err)
	}
	if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Fatalf("postmaster %d still exists after Stop (kill 0: %v)", pid, err)
	}
	if left := stillAlive(procs...); len(left) > 0 {
		t.Fatalf("postgres processes %v still alive after Stop", left)
	}
	if err := c.Stop(); err != nil {
		t.Fatalf("second Stop: %v", err)
	}
	if c.PID() != 0 {
		t.Fatalf("PID() after Stop = %d", c.PID())
	}
	if err := c.Restart(ctx, "fast"); err == nil {
		t.Fatal("Restart after Stop succeeded")
	}
	if err := c.Signal(syscall.SIGCONT); err == nil {
		t.Fatal("Signal after Stop succeeded")
	}
}

func TestUnixOnly(t *testing.T) {
	var log bytes.Buffer // read only after Stop, which waits for the copying
	c, err := Start(context.Background(), Options{Settings: testSettings(), Log: &log})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	if s := c.TCPConnString("postgres"); s != "" {
		t.Fatalf("TCPConnString without TCP = %q", s)
	}
	if got := mustQueryInt(t, c.ConnString("postgres"), "SELECT (current_setting('listen_addresses') = '')::int"); got != 1 {
		t.Fatal("listen_addresses is not empty")
	}
	if err := c.Stop(); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"performing post-bootstrap initialization", "ready to accept connections", "database system is shut down"} {
		if !strings.Contains(log.String(), want) {
			t.Errorf("Options.Log lacks %q:\n%s", want, log.String())
		}
	}
}

func TestStartFailureReportsLogAndCleansUp(t *testing.T) {
	// A private TMPDIR lets us see that the failed cluster's dir is gone.
	tmp, err := os.MkdirTemp("", "pgct")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(tmp)
	if err := os.Chmod(tmp, 0o755); err != nil { // the server user must reach it
		t.Fatal(err)
	}
	t.Setenv("TMPDIR", tmp)

	_, err = Start(context.Background(), Options{Settings: map[string]string{"no_such_setting": "1"}})
	if err == nil {
		t.Fatal("Start with a bogus setting succeeded")
	}
	t.Logf("error: %v", err)
	if !strings.Contains(err.Error(), `unrecognized configuration parameter "no_such_setting"`) {
		t.Fatalf("error lacks the server log tail: %v", err)
	}
	left, _ := os.ReadDir(tmp)
	if len(left) != 0 {
		t.Fatalf("failed Start left %v in TMPDIR", left)
	}
}

func TestBadBinDir(t *testing.T) {
	_, err := Start(context.Background(), Options{BinDir: t.TempDir()})
	if err == nil || !strings.Contains(err.Error(), "does not contain") {
		t.Fatalf("Start with an empty BinDir: %v", err)
	}
}

// TestServerDiesWithParent kills -9 a process that started a cluster and
// checks that the server goes too (Pdeathsig on the pinned fork thread).
func TestServerDiesWithParent(t *testing.T) {
	if os.Getenv("PGCLUSTER_TEST_HELPER") == "1" {
		c, err := Start(context.Background(), Options{Settings: testSettings()})
		if err != nil {
			fmt.Println("ERROR", err)
			os.Exit(1)
		}
		fmt.Printf("READY %d %s\n", c.PID(), c.Dir())
		select {} // wait to be killed
	}

	helper := exec.Command(os.Args[0], "-test.run=^TestServerDiesWithParent$", "-test.count=1")
	helper.Env = append(os.Environ(), "PGCLUSTER_TEST_HELPER=1")
	helper.Stderr = os.Stderr
	out, err := helper.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := helper.Start(); err != nil {
		t.Fatal(err)
	}
	defer helper.Process.Kill()
	var pid int
	var dir string
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "ERROR") {
			t.Fatal(line)
		}
		if _, err := fmt.Sscanf(line, "READY %d %s", &pid, &dir); err == nil {
			break
		}
	}
	if pid == 0 {
		t.Fatal("helper did not report a started cluster")
	}
	defer os.RemoveAll(dir) // the helper had no chance to clean up

	realDir, err := filepath.EvalSymlinks(dir)
	if err != nil {
		t.Fatal(err)
	}
	procs := serverProcs(filepath.Join(realDir, "data"))
	if len(procs) < 2 {
		t.Fatalf("serverProcs found %v, want the postmaster and its children (checkpointer etc.)", procs)
	}
	if err := helper.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = helper.Wait()
	t0 := time.Now()
	deadline := t0.Add(15 * time.Second)
	for {
		left := stillAlive(procs...)
		if len(left) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("server processes %v still alive 15s after their parent was killed", left)
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("server gone %v after kill -9 of its parent", time.Since(t0))

	// The next Start sweeps the orphaned dir.
	SweepStale(filepath.Join(filepath.Dir(dir), "bellhop-pg*"), "server.log")
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("sweepStale left the orphaned dir %s (stat: %v)", dir, err)
	}
}

func TestQuoteDSNValue(t *testing.T) {
	for in, want := range map[string]string{
		"/tmp/bellhop-pg1": "/tmp/bellhop-pg1",
		"":                 "''",
		"a b":              "'a b'",
		`it's\`:            `'it\'s\\'`,
	} {
		if got := quoteDSNValue(in); got != want {
			t.Errorf("quoteDSNValue(%q) = %q, want %q", in, got, want)
		}
	}
	cfg, err := pgx.ParseConfig("host=" + quoteDSNValue("/tmp/a b") + " dbname=" + quoteDSNValue(`x'y`))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Host != "/tmp/a b" || cfg.Database != `x'y` {
		t.Fatalf("round trip: host %q db %q", cfg.Host, cfg.Database)
	}
}

func TestVersionOrder(t *testing.T) {
	if !(versionOf("/usr/lib/postgresql/15/bin") > versionOf("/usr/lib/postgresql/9.6/bin")) {
		t.Fatal("15 should sort above 9.6")
	}
}
