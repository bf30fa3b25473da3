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
