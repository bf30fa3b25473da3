// Package pgbouncer starts a throwaway PgBouncer in front of a PostgreSQL
// server, for tests of what goes through a connection pooler.
package pgbouncer

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bellhopq/bellhop/internal/pgcluster"
)

// Options configures a Bouncer.
type Options struct {
	// Server is a connection string of the server to pool, whose host,
	// port, user and password PgBouncer logs in with (any database).
	Server string
	// PoolMode is session, transaction or statement.
	PoolMode string
	// PoolSize is the server connections per database and user.
	PoolSize int
	// IgnoreStartupParameters are start-up parameters that PgBouncer
	// accepts and drops (pgx v5 itself sends none it refuses).
	IgnoreStartupParameters []string
}

// Bouncer is a running PgBouncer.
type Bouncer struct {
	cmd  *exec.Cmd
	lock *os.File // held while the dir is in use (pgcluster.SweepStale)
	dir  string
	port int
	user string
	done chan struct{}
}

// Find returns the path of the pgbouncer binary: on PATH, or where
// Debian's package puts it.
func Find() (string, error) {
	if p, err := exec.LookPath("pgbouncer"); err == nil {
		return p, nil
	}
	const debian = "/usr/sbin/pgbouncer"
	if _, err := os.Stat(debian); err == nil {
		return debian, nil
	}
	return "", errors.New("pgbouncer: no pgbouncer binary on PATH or at /usr/sbin/pgbouncer (Debian: apt-get install pgbouncer)")
}

// Start runs PgBouncer on a free 127.0.0.1 port, as the unprivileged
// user when running as root (it refuses to run as root), and waits until
// it passes a query through.
func Start(ctx context.Context, opts Options) (b *Bouncer, err error) {
	bin, err := Find()
	if err != nil {
		return nil, err
	}
	server, err := pgconn.ParseConfig(opts.Server)
	if err != nil {
		return nil, fmt.Errorf("pgbouncer: server connection string: %w", err)
	}
	cred, err := pgcluster.ServerCredential()
	if err != nil {
		return nil, err
	}
	// Dirs of bouncers whose test died without Stop (kill -9, a test
	// timeout): PgBouncer died with it (Pdeathsig), and nobody holds the
	// dir's lock any more.
	pgcluster.SweepStale("/tmp/bellhop-pgbouncer*", "lock")
	dir, err := os.MkdirTemp("/tmp", "bellhop-pgbouncer")
	if err != nil {
		return nil, fmt.Errorf("pgbouncer: create temp dir: %w", err)
	}
	lock, err := os.Create(filepath.Join(dir, "lock"))
	if err == nil {
		err = syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
	}
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("pgbouncer: lock %s: %w", dir, err)
	}
	defer func() {
		if err != nil {
			_ = lock.Close()
			_ = os.RemoveAll(dir)
		}
	}()
	port, err := pgcluster.FreePort()
	if err != nil {
		return nil, err
	}
	b = &Bouncer{lock: lock, dir: dir, port: port, user: server.User, done: make(chan struct{})}
	// Clients are trusted; PgBouncer logs in to the server as the server
	// string's user, with its password if it has one.
	db := fmt.Sprintf("host=%s port=%d user=%s", quote(server.Host), server.Port, quote(server.User))
	if server.Password != "" {
		db += " password=" + quote(server.Password)
	}
	ini := strings.Join([]string{
		"[databases]",
		"* = " + db,
		"[pgbouncer]",
		"listen_addr = 127.0.0.1",
		"listen_port = " + strconv.Itoa(port),
		"unix_socket_dir =",
		"auth_type = trust",
		"auth_file = " + filepath.Join(dir, "users.txt"),
		"pool_mode = " + opts.PoolMode,
		"default_pool_size = " + strconv.Itoa(max(opts.PoolSize, 1)),
		"max_client_conn = 500",
		"logfile = " + filepath.Join(dir, "pgbouncer.log"),
		// PgBouncer refuses a start-up parameter it does not track.
		"ignore_startup_parameters = " + strings.Join(opts.IgnoreStartupParameters, ","),
		"",
	}, "\n")
	users := fmt.Sprintf("%q \"\"\n", server.User)
	for name, text := range map[string]string{"pgbouncer.ini": ini, "users.txt": users} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o600); err != nil {
			return nil, fmt.Errorf("pgbouncer: write %s: %w", name, err)
		}
	}
	if cred != nil {
		for _, p := range []string{dir, filepath.Join(dir, "pgbouncer.ini"), filepath.Join(dir, "users.txt")} {
			if err := os.Chown(p, int(cred.Uid), int(cred.Gid)); err != nil {
				return nil, fmt.Errorf("pgbouncer: chown %s: %w", p, err)
			}
		}
	}
	b.cmd = exec.Command(bin, filepath.Join(dir, "pgbouncer.ini"))
	// It dies with the test binary, even on kill -9 or a test timeout,
	// which skip Stop.
	b.cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred, Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := pgcluster.StartPinned(b.cmd); err != nil {
		return nil, fmt.Errorf("pgbouncer: start %s: %w", bin, err)
	}
	go func() {
		_ = b.cmd.Wait()
		close(b.done)
	}()
	if err := b.waitReady(ctx, server.Database); err != nil {
		_ = b.Stop()
		return nil, err
	}
	return b, nil
}

// waitReady waits until a query on dbname passes through, for up to 10s.
func (b *Bouncer) waitReady(ctx context.Context, dbname string) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for {
		conn, err := pgx.Connect(ctx, b.ConnString(dbname))
		if err == nil {
			_, err = conn.Exec(ctx, "SELECT 1")
			_ = conn.Close(ctx)
			if err == nil {
				return nil
			}
		}
		select {
		case <-b.done:
			return fmt.Errorf("pgbouncer: exited at start-up: %s", b.logTail())
		case <-ctx.Done():
			return fmt.Errorf("pgbouncer: not ready within 10s (%v): %s", err, b.logTail())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// ConnString returns a URL connection string for dbname through PgBouncer.
func (b *Bouncer) ConnString(dbname string) string {
	u := url.URL{
		Scheme:   "postgres",
		User:     url.User(b.user),
		Host:     net.JoinHostPort("127.0.0.1", strconv.Itoa(b.port)),
		Path:     "/" + dbname,
		RawQuery: "sslmode=disable",
	}
	return u.String()
}

// Stop ends PgBouncer at once, closing its connections, and removes its
// files.
func (b *Bouncer) Stop() error {
	_ = b.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-b.done:
	case <-time.After(10 * time.Second):
		_ = b.cmd.Process.Kill()
		<-b.done
	}
	_ = b.lock.Close()
	return os.RemoveAll(b.dir)
}

func (b *Bouncer) logTail() string {
	data, _ := os.ReadFile(filepath.Join(b.dir, "pgbouncer.log"))
	if len(data) > 2000 {
		data = data[len(data)-2000:]
	}
	return strings.TrimSpace(string(data))
}

// quote quotes a libpq connection-string value for PgBouncer's
// [databases] section.
func quote(v string) string {
	r := strings.NewReplacer(`\`, `\\`, `'`, `\'`)
	return "'" + r.Replace(v) + "'"
}
