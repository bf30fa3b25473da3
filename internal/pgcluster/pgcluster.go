// Package pgcluster starts and stops a throwaway PostgreSQL cluster from the
// server binaries installed on the machine.
//
// It backs the test harness (internal/pgtest), `bellhop demo`, the benchmark
// command and the chaos tests, so it favours three things over features:
// nothing may outlive the process that started the server (no orphaned
// postgres, no leftover temp dir), it must work when run as root (CI
// containers), and it must support restarting and freezing the server in
// place so clients can be tested against outages.
package pgcluster

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

const (
	// readyTimeout bounds how long a (re)started server may take to accept
	// connections. Crash recovery after an immediate restart is included.
	readyTimeout = 30 * time.Second
	// readyPoll is short because a fresh cluster is usually ready in ~40ms
	// and callers (tests) pay for every extra millisecond.
	readyPoll = 10 * time.Millisecond
	// stopTimeout is generous because a fast shutdown writes a checkpoint,
	// which with fsync on and dirty shared buffers (benchmarks) takes
	// seconds; after it the process group is killed.
	stopTimeout = 30 * time.Second
	// maxSocketPath is the usable length of sun_path on Linux; postgres
	// refuses to start when the socket path would be longer.
	maxSocketPath = 107
)

// Options configures Start. The zero value starts a unix-socket-only server
// with PostgreSQL's default durability settings.
type Options struct {
	// BinDir holds initdb and postgres; "" means FindBinDir.
	BinDir string
	// Settings are extra server settings passed as -c key=value. They are
	// applied after the package defaults, so they may override them (for
	// example max_connections). Durability settings are deliberately not
	// defaulted here: tests pass fsync=off, benchmarks must not.
	Settings map[string]string
	// TCP makes the server also listen on 127.0.0.1 (on the same port that
	// names the unix socket). Off by default so parallel clusters never
	// collide on a TCP port.
	TCP bool
	// Log, if non-nil, receives a copy of the server's output, written
	// from a goroutine of os/exec. The output always goes to
	// <Dir>/server.log too, so a failed start can report it.
	Log io.Writer
}

// Cluster is a running throwaway PostgreSQL server. Its methods are safe
// for concurrent use.
type Cluster struct {
	binDir  string
	dir     string
	dataDir string // dir/data with symlinks resolved, as /proc/<pid>/cwd shows it
	port    int
	tcp     bool
	cred    *syscall.Credential
	args    []string
	out     io.Writer // what the server's stdout and stderr are connected to
	logf    *os.File  // <dir>/server.log

	mu      sync.Mutex
	proc    *server // nil while no server runs (stopped, or a restart failed)
	stopped bool
}

// server is one run of the postmaster; a Restart replaces it.
type server struct {
	cmd  *exec.Cmd
	done chan struct{} // closed when cmd.Wait returned
	err  error         // cmd.Wait's result, valid after done is closed
}

// FindBinDir locates the directory holding the PostgreSQL server binaries
// (initdb and postgres). It tries `pg_config --bindir`, then the highest
// version under /usr/lib/postgresql/*/bin (Debian/Ubuntu keep the server
// off PATH), then PATH.
func FindBinDir() (string, error) {
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		// pg_config may come from the client-only package and name a
		// directory without the server binaries, hence the check.
		if dir := strings.TrimSpace(string(out)); hasServerBinaries(dir) {
			return dir, nil
		}
	}
	matches, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(matches, func(i, j int) bool {
		return versionOf(matches[i]) > versionOf(matches[j])
	})
	for _, dir := range matches {
		if hasServerBinaries(dir) {
			return dir, nil
		}
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		if dir := filepath.Dir(p); hasServerBinaries(dir) {
			return dir, nil
		}
	}
	return "", errors.New("pgcluster: no PostgreSQL server binaries (initdb, postgres) found via pg_config --bindir, " +
		"/usr/lib/postgresql/*/bin or PATH: install them (e.g. apt-get install postgresql-15), " +
		"or set DATABASE_URL to use an existing PostgreSQL server")
}

// versionOf extracts N from /usr/lib/postgresql/N/bin so that 15 sorts
// above 9.6 (a string sort would not).
func versionOf(binDir string) float64 {
	v, err := strconv.ParseFloat(filepath.Base(filepath.Dir(binDir)), 64)
	if err != nil {
		return -1
	}
	return v
}

func hasServerBinaries(dir string) bool {
	if dir == "" {
		return false
	}
	for _, name := range []string{"initdb", "postgres"} {
		fi, err := os.Stat(filepath.Join(dir, name))
		if err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
			return false
		}
	}
	return true
}

// Start creates a new cluster in a fresh temp dir and runs its server until
// Stop. On error nothing is left behind. ctx bounds initdb and the wait for
// the server to accept connections, not the server's lifetime.
func Start(ctx context.Context, opts Options) (c *Cluster, err error) {
	binDir := opts.BinDir
	if binDir == "" {
		if binDir, err = FindBinDir(); err != nil {
			return nil, err
		}
	} else if !hasServerBinaries(binDir) {
		return nil, fmt.Errorf("pgcluster: %s does not contain the PostgreSQL server binaries initdb and postgres", binDir)
	}
	cred, err := ServerCredential()
	if err != nil {
		return nil, err
	}

	parent := tempParent(cred != nil)
	SweepStale(filepath.Join(parent, "bellhop-pg*"), "server.log")
	dir, err := os.MkdirTemp(parent, "bellhop-pg")
	if err != nil {
		return nil, fmt.Errorf("pgcluster: create temp dir: %w", err)
	}
	defer func() {
		if err != nil {
			_ = os.RemoveAll(dir)
		}
	}()
	if cred != nil {
		// The dir is still empty, so chowning it is chowning it recursively.
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			return nil, fmt.Errorf("pgcluster: chown %s: %w", dir, err)
		}
	}
	logf, err := os.OpenFile(filepath.Join(dir, "server.log.new"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("pgcluster: create server log: %w", err)
	}
	defer func() {
		if err != nil {
			_ = logf.Close()
		}
	}()
	// The lock marks the dir as in use for SweepStale. It lives as long as
	// any process holds the log's open file: us, and the server processes
	// that get it as stdout/stderr. The file only gets its final name once
	// locked, so a concurrent sweep never sees it unlocked.
	if err := syscall.Flock(int(logf.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		return nil, fmt.Errorf("pgcluster: lock server log: %w", err)
	}
	if err := os.Rename(logf.Name(), filepath.Join(dir, "server.log")); err != nil {
		return nil, fmt.Errorf("pgcluster: create server log: %w", err)
	}
	var out io.Writer = logf
	if opts.Log != nil {
		out = io.MultiWriter(logf, opts.Log)
	}

	initdb := exec.CommandContext(ctx, filepath.Join(binDir, "initdb"),
		"-D", filepath.Join(dir, "data"), "-U", "postgres", "-A", "trust", "-E", "UTF8",
		"--locale=C", "--no-sync", "--no-instructions")
	initdb.Dir = dir // the server user may not be able to enter the caller's cwd
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	initdb.Stdout, initdb.Stderr = out, out
	if err := initdb.Run(); err != nil {
		return nil, fmt.Errorf("pgcluster: initdb: %w%s", err, logTail(dir))
	}

	realDir, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return nil, fmt.Errorf("pgcluster: %w", err)
	}
	c = &Cluster{binDir: binDir, dir: dir, dataDir: filepath.Join(realDir, "data"),
		tcp: opts.TCP, cred: cred, out: out, logf: logf}
	// A TCP port picked by binding :0 can be taken by someone else before
	// postgres binds it; retry with a fresh port when that happens. Without
	// TCP the port only names the socket file inside our own dir.
	for attempt := 1; ; attempt++ {
		if c.port, err = FreePort(); err != nil {
			return nil, err
		}
		c.args = serverArgs(dir, c.port, opts)
		err = c.start(ctx)
		if err == nil {
			return c, nil
		}
		if !opts.TCP || attempt == 3 || !strings.Contains(logTail(dir), "could not bind") {
			return nil, err
		}
	}
}

// serverArgs builds the postmaster's command line. Settings are sorted so
// the command line (visible in ps and the log) is stable.
func serverArgs(dir string, port int, opts Options) []string {
	settings := map[string]string{
		"listen_addresses": "",
		"max_connections":  "300",
	}
	if opts.TCP {
		settings["listen_addresses"] = "127.0.0.1"
	}
	for k, v := range opts.Settings {
		settings[k] = v
	}
	keys := make([]string, 0, len(settings))
	for k := range settings {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	args := []string{"-D", filepath.Join(dir, "data"), "-k", dir, "-p", strconv.Itoa(port)}
	for _, k := range keys {
		args = append(args, "-c", k+"="+settings[k])
	}
	return args
}

// ServerCredential returns the user to run initdb and postgres (and
// PgBouncer) as: they refuse to run as root, so root drops to `postgres`
// (or `nobody`). Nil when not running as root.
func ServerCredential() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	var errs []error
	for _, name := range []string{"postgres", "nobody"} {
		u, err := user.Lookup(name)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
		gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
		if err1 != nil || err2 != nil {
			errs = append(errs, fmt.Errorf("user %s: bad uid/gid %q/%q", name, u.Uid, u.Gid))
			continue
		}
		return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
	}
	return nil, fmt.Errorf("pgcluster: running as root and no unprivileged user to run postgres as: %w", errors.Join(errs...))
}

// tempParent picks where the cluster dir goes: os.TempDir() unless the
// socket path would be too long, or (as root) the server user could not
// reach it, in which case /tmp.
func tempParent(dropsPrivileges bool) string {
	parent := os.TempDir()
	// bellhop-pg + up to 10 random digits, then the socket file name.
	if len(parent)+len("/bellhop-pg0123456789/.s.PGSQL.65535") > maxSocketPath {
		return "/tmp"
	}
	if dropsPrivileges && !searchableByOthers(parent) {
		return "/tmp"
	}
	return parent
}

func searchableByOthers(dir string) bool {
	for d := filepath.Clean(dir); ; d = filepath.Dir(d) {
		fi, err := os.Stat(d)
		if err != nil || fi.Mode().Perm()&0o001 == 0 {
			return false
		}
		if d == "/" || d == "." {
			return true
		}
	}
}

// SweepStale removes the dirs that glob matches and that processes that
// died without cleaning up (kill -9, a `go test -timeout` panic, os.Exit
// in a test) left behind: a cluster's holds a copy of the 40MB data dir.
// A dir is stale when nobody holds the flock on its file lockName (a
// cluster's server.log); dirs without one may be mid-creation and are
// left alone. Best effort: errors are ignored.
func SweepStale(glob, lockName string) {
	dirs, _ := filepath.Glob(glob)
	for _, dir := range dirs {
		f, err := os.Open(filepath.Join(dir, lockName))
		if err != nil {
			continue
		}
		if syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) == nil {
			_ = os.RemoveAll(dir)
		}
		_ = f.Close()
	}
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("pgcluster: pick a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// start runs the postmaster and waits until it accepts connections. The
// caller holds c.mu or has not published c yet.
func (c *Cluster) start(ctx context.Context) error {
	cmd := exec.Command(filepath.Join(c.binDir, "postgres"), c.args...)
	cmd.Dir = c.dir // avoids "could not change directory" when cwd is root-only
	cmd.Stdout, cmd.Stderr = c.out, c.out
	// Bounds Wait if a straggler backend kept the output pipe open.
	cmd.WaitDelay = 5 * time.Second
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Credential: c.cred,
		// Own process group, so a ^C in the terminal (SIGINT to the
		// foreground group) does not shut the server down behind the
		// caller's back, e.g. while `bellhop demo` drains its workers.
		Setpgid: true,
		// The server must die with us, even on kill -9; see forkPinned.
		Pdeathsig: syscall.SIGQUIT,
	}
	if err := forkPinned(cmd); err != nil {
		return fmt.Errorf("pgcluster: start postgres: %w", err)
	}
	s := &server{cmd: cmd, done: make(chan struct{})}
	go func() {
		s.err = cmd.Wait()
		close(s.done)
	}()
	if err := c.waitReady(ctx, s); err != nil {
		return errors.Join(err, c.killServer(s))
	}
	c.proc = s
	return nil
}

// waitReady polls until the server accepts a connection, the server exits,
// ctx ends or readyTimeout passes.
func (c *Cluster) waitReady(ctx context.Context, s *server) error {
	ctx, cancel := context.WithTimeout(ctx, readyTimeout)
	defer cancel()
	dsn := c.ConnString("postgres")
	tick := time.NewTicker(readyPoll)
	defer tick.Stop()
	var lastErr error
	for {
		attemptCtx, cancelAttempt := context.WithTimeout(ctx, time.Second)
		conn, err := pgx.Connect(attemptCtx, dsn)
		cancelAttempt()
		if err == nil {
			_ = conn.Close(context.Background())
			return nil
		}
		lastErr = err
		select {
		case <-s.done:
			return fmt.Errorf("pgcluster: postgres exited during startup (%v)%s", s.err, logTail(c.dir))
		case <-ctx.Done():
			return fmt.Errorf("pgcluster: postgres not accepting connections: %w (last attempt: %v)%s",
				ctx.Err(), lastErr, logTail(c.dir))
		case <-tick.C:
		}
	}
}

// Pdeathsig is delivered when the *thread* that forked the child exits, not
// the process. Go exits idle OS threads at will (and always exits a thread
// whose goroutine returns while locked), so forking from an arbitrary
// goroutine would kill the server at a random moment. All servers are
// therefore forked from one goroutine that locks its thread and never
// unlocks or returns: that thread lives exactly as long as the process, so
// the server dies when the process does, including on kill -9.
var (
	forkOnce sync.Once
	forkReqs chan forkReq
)

type forkReq struct {
	cmd  *exec.Cmd
	errc chan error
}

// StartPinned starts cmd as the servers are started, so that a Pdeathsig
// in its SysProcAttr fires when this process dies, not when some thread
// of it exits: for other processes a test starts, such as PgBouncer.
func StartPinned(cmd *exec.Cmd) error { return forkPinned(cmd) }

func forkPinned(cmd *exec.Cmd) error {
	forkOnce.Do(func() {
		forkReqs = make(chan forkReq)
		go func() {
			runtime.LockOSThread() // never unlocked: see above
			for r := range forkReqs {
				r.errc <- r.cmd.Start()
			}
		}()
	})
	errc := make(chan error, 1)
	forkReqs <- forkReq{cmd: cmd, errc: errc}
	return <-errc
}

// ConnString returns a keyword/value DSN for dbname over the unix socket.
// The socket needs no port coordination and works even when TCP is off.
func (c *Cluster) ConnString(dbname string) string {
	return fmt.Sprintf("host=%s port=%d user=postgres dbname=%s sslmode=disable",
		quoteDSNValue(c.dir), c.port, quoteDSNValue(dbname))
}

// TCPConnString returns a URL DSN for dbname over 127.0.0.1, for clients
// that cannot use unix sockets, or "" when the cluster was started without
// TCP.
func (c *Cluster) TCPConnString(dbname string) string {
	if !c.tcp {
		return ""
	}
	u := url.URL{
		Scheme:   "postgres",
		User:     url.User("postgres"),
		Host:     net.JoinHostPort("127.0.0.1", strconv.Itoa(c.port)),
		Path:     "/" + dbname,
		RawQuery: "sslmode=disable",
	}
	return u.String()
}

// quoteDSNValue quotes a keyword/value DSN value when it needs it, so odd
// temp dirs or database names cannot break the DSN.
func quoteDSNValue(v string) string {
	if v != "" && !strings.ContainsAny(v, " \t\n\r\v\f'\\") {
		return v
	}
	r := strings.NewReplacer(`\`, `\\`, `'`, `\'`)
	return "'" + r.Replace(v) + "'"
}

// Dir is the cluster's temp dir: data/ holds the cluster, server.log the
// server output, and the unix socket lives directly inside it.
func (c *Cluster) Dir() string { return c.dir }

// Port is the port that names the unix socket (and the TCP port if TCP is
// on). It stays the same across restarts.
func (c *Cluster) Port() int { return c.port }

// PID returns the postmaster's pid, which changes on Restart; 0 once the
// cluster is stopped.
func (c *Cluster) PID() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.proc == nil {
		return 0
	}
	return c.proc.cmd.Process.Pid
}

// Signal sends sig to the whole server: the postmaster, then each of its
// children (backends, background workers). Freezing only the postmaster
// (SIGSTOP) would leave established connections working, which is not what
// a freeze test wants. Use SIGCONT to thaw; Stop and Restart also thaw a
// frozen server. SIGKILL here simulates a crash; Restart then starts the
// server again, with crash recovery.
func (c *Cluster) Signal(sig os.Signal) error {
	ssig, ok := sig.(syscall.Signal)
	if !ok {
		return fmt.Errorf("pgcluster: signal %v is not a syscall.Signal", sig)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.proc == nil {
		return errors.New("pgcluster: signal: cluster is stopped")
	}
	select {
	case <-c.proc.done:
		return fmt.Errorf("pgcluster: signal: postgres has exited (%v)", c.proc.err)
	default:
	}
	if err := c.signalServer(c.proc.cmd.Process.Pid, ssig); err != nil {
		return fmt.Errorf("pgcluster: signal %v: %w", sig, err)
	}
	return nil
}

// signalServer signals the postmaster, then every other process of the
// server. The process group is no help: each postgres child calls setsid().
// The postmaster goes first so that, once stopped or killed, it forks no
// child that the scan would miss.
func (c *Cluster) signalServer(pid int, sig syscall.Signal) error {
	if err := syscall.Kill(pid, sig); err != nil {
		return err
	}
	for _, p := range serverProcs(c.dataDir) {
		if p != pid {
			_ = syscall.Kill(p, sig) // it may have exited meanwhile
		}
	}
	return nil
}

// serverProcs lists the live processes of the server whose data dir is
// dataDir (with symlinks resolved). postgres chdirs into its data dir and
// its children inherit that, so /proc/<pid>/cwd finds them even after a
// killed postmaster's children were reparented. Zombies are skipped: they
// hold no memory, sockets or files.
func serverProcs(dataDir string) []int {
	var pids []int
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if cwd, err := os.Readlink("/proc/" + e.Name() + "/cwd"); err != nil || cwd != dataDir {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// "pid (comm) state ...": comm may hold spaces and parentheses.
		st := string(b)
		if f := strings.Fields(st[strings.LastIndexByte(st, ')')+1:]); len(f) > 0 && f[0] != "Z" {
			pids = append(pids, pid)
		}
	}
	return pids
}

// waitServerGone waits until no process of the server is left, killing
// stragglers after a while. A new postmaster refuses to start while an old
// backend still holds the shared memory, and Stop promises to leave nothing
// behind; a SIGKILLed postmaster's children take a moment to notice.
func (c *Cluster) waitServerGone() error {
	const grace = 5 * time.Second
	deadline := time.Now().Add(grace)
	killed := false
	for {
		procs := serverProcs(c.dataDir)
		if len(procs) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			if killed {
				return fmt.Errorf("postgres processes %v survived SIGKILL", procs)
			}
			for _, p := range procs {
				_ = syscall.Kill(p, syscall.SIGKILL)
			}
			killed, deadline = true, time.Now().Add(grace)
		}
		time.Sleep(readyPoll)
	}
}

// Restart stops the server and starts it again on the same port and data
// dir, so existing DSNs stay valid and clients see a real outage. mode
// "fast" (SIGINT) disconnects clients and checkpoints; "immediate"
// (SIGQUIT) stops without a checkpoint, so the next start runs crash
// recovery. If the server has already exited (e.g. after Signal(SIGKILL)),
// Restart just starts it. It returns once the server accepts connections.
func (c *Cluster) Restart(ctx context.Context, mode string) error {
	var sig syscall.Signal
	switch mode {
	case "fast":
		sig = syscall.SIGINT
	case "immediate":
		sig = syscall.SIGQUIT
	default:
		return fmt.Errorf("pgcluster: restart: unknown mode %q (want \"fast\" or \"immediate\")", mode)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stopped {
		return errors.New("pgcluster: restart: cluster is stopped")
	}
	if c.proc != nil {
		err := c.shutdown(c.proc, sig)
		c.proc = nil // gone either way: shutdown kills what does not stop
		if err != nil {
			return fmt.Errorf("pgcluster: restart: %w", err)
		}
	}
	if err := c.start(ctx); err != nil {
		return fmt.Errorf("pgcluster: restart: %w", err)
	}
	return nil
}

// Stop shuts the server down (fast mode, then SIGKILL after a timeout),
// waits until no server process is left, and removes the temp dir with the data. It is
// idempotent, so it can be both deferred and called explicitly.
func (c *Cluster) Stop() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stopped {
		return nil
	}
	c.stopped = true
	var errs []error
	if c.proc != nil {
		if err := c.shutdown(c.proc, syscall.SIGINT); err != nil {
			errs = append(errs, err)
		}
		c.proc = nil
	}
	if err := c.logf.Close(); err != nil {
		errs = append(errs, fmt.Errorf("close server log: %w", err))
	}
	if err := os.RemoveAll(c.dir); err != nil {
		errs = append(errs, fmt.Errorf("remove %s: %w", c.dir, err))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("pgcluster: stop: %w", err)
	}
	return nil
}

// shutdown asks the postmaster to stop with sig and waits until every
// server process is gone. The SIGCONT thaws a server frozen by
// Signal(SIGSTOP), which would otherwise never act on sig (a pending SIGINT
// is acted on once thawed). If the postmaster is stuck, the server is
// killed.
func (c *Cluster) shutdown(s *server, sig syscall.Signal) error {
	select {
	case <-s.done:
		// Already gone (crashed or killed); its children may not be yet.
		return c.waitServerGone()
	default:
	}
	pid := s.cmd.Process.Pid
	if err := syscall.Kill(pid, sig); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("signal postgres: %w", err)
	}
	_ = c.signalServer(pid, syscall.SIGCONT)
	select {
	case <-s.done:
		return c.waitServerGone()
	case <-time.After(stopTimeout):
	}
	return errors.Join(
		fmt.Errorf("postgres did not stop within %v after %v; killed it", stopTimeout, sig),
		c.killServer(s))
}

// killServer SIGKILLs every server process and its process group, and
// waits until they are gone.
func (c *Cluster) killServer(s *server) error {
	pid := s.cmd.Process.Pid
	_ = c.signalServer(pid, syscall.SIGKILL)
	_ = syscall.Kill(-pid, syscall.SIGKILL)
	<-s.done
	return c.waitServerGone()
}

// logTail returns the end of server.log, formatted to be appended to an
// error, because the reason a server fails to start is only in its log.
func logTail(dir string) string {
	const maxBytes = 4096
	const maxLines = 30
	f, err := os.Open(filepath.Join(dir, "server.log"))
	if err != nil {
		return ""
	}
	defer f.Close()
	if fi, err := f.Stat(); err == nil && fi.Size() > maxBytes {
		_, _ = f.Seek(-maxBytes, io.SeekEnd)
	}
	b, _ := io.ReadAll(f)
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > maxLines {
		lines = lines[len(lines)-maxLines:]
	}
	text := strings.Join(lines, "\n")
	if strings.TrimSpace(text) == "" {
		return ""
	}
	return "\n--- server.log (tail) ---\n" + text
}
