package pgdsn

import (
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

func TestWithDatabase(t *testing.T) {
	for _, in := range []string{
		"postgres://u:p@db.example:5433/app?sslmode=disable",
		"postgresql://u@db.example/app?dbname=other&sslmode=disable",
		"postgres://u@db.example:5433",
		"host=/tmp/x port=5 user=u dbname=app sslmode=disable",
		"host=/tmp/x port=5 user=u database=app",
		"host=/tmp/x port=5",
	} {
		out, err := WithDatabase(in, "bellhop_t_1")
		if err != nil {
			t.Fatalf("WithDatabase(%q): %v", in, err)
		}
		cfg, err := pgconn.ParseConfig(out)
		if err != nil {
			t.Fatalf("WithDatabase(%q) = %q: %v", in, out, err)
		}
		if cfg.Database != "bellhop_t_1" {
			t.Errorf("WithDatabase(%q) = %q: database %q", in, out, cfg.Database)
		}
		orig, _ := pgconn.ParseConfig(in)
		if cfg.Host != orig.Host || cfg.Port != orig.Port || cfg.User != orig.User || cfg.Password != orig.Password {
			t.Errorf("WithDatabase(%q) = %q changed more than the database", in, out)
		}
	}
}

// TestDatabaseURL runs this test binary twice at once against the current
// server through DATABASE_URL, as parallel `go test` packages would.
func TestWithDatabaseExact(t *testing.T) {
	got, err := WithDatabase("postgres://u@h:5/x?sslmode=disable&dbname=y", "z")
	if err != nil || got != "postgres://u@h:5/z?sslmode=disable" {
		t.Errorf("url: %q %v", got, err)
	}
	got, err = WithDatabase("host='/tmp/a b' port=5 dbname=x", "z")
	if err != nil || !strings.HasSuffix(got, "dbname=z") {
		t.Errorf("kv: %q %v", got, err)
	}
}

func TestWithUser(t *testing.T) {
	for _, tc := range []struct{ dsn, want string }{
		{"postgres://alice@localhost:5432/db?sslmode=disable", "postgres://bob@localhost:5432/db?sslmode=disable"},
		{"postgres://alice:secret@localhost/db", "postgres://bob:secret@localhost/db"},
		{"postgres:///db?host=%2Ftmp&port=5432&user=alice", "postgres://bob@/db?host=%2Ftmp&port=5432"},
		{"host=/tmp port=5432 user=alice dbname=db", "host=/tmp port=5432 user=alice dbname=db user=bob"},
	} {
		got, err := WithUser(tc.dsn, "bob")
		if err != nil {
			t.Fatalf("WithUser(%q): %v", tc.dsn, err)
		}
		if got != tc.want {
			t.Errorf("WithUser(%q) = %q; want %q", tc.dsn, got, tc.want)
		}
		cfg, err := pgconn.ParseConfig(got)
		if err != nil || cfg.User != "bob" {
			t.Errorf("WithUser(%q) = %q, which connects as %q (%v); want bob", tc.dsn, got, cfg.User, err)
		}
	}
}

// TestCheckHosts: a host name with '@' comes from an unescaped '@' in a
// URL's user info, and is refused; a socket directory's path may hold one.
// An '@' after the user info, or without user info in the database name
// or a parameter's name (CheckURL), comes from an unescaped '@' or '/' in
// the user info, which pgx reads as its end or the end of the host: the
// rest of the password became a host, the database name or parameters,
// sent to the wrong host and printed in connection errors. Neither error
// quotes the password.
func TestCheckHosts(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		dsn string
		ok  bool
	}{
		{"postgres://u:pw@db.example.com/x", true},
		{"postgres://u:p%40w@db.example.com/x", true},
		{"host=/run/user@1000/pg user=u", true},
		{"postgres://u:p@ss3cret@db.example.com/x", false},
		{"postgres://u@a.example.com,b@c.example.com/x", false},
		// '/' in the user info, escaped or not.
		{"postgres://u:%2Fss3cret@db.example.com/x", true},
		{"postgres://u:2024%2Fss3cret@db.example.com/x", true},
		{"postgres://u:/ss3cret@db.example.com/x", false},
		{"postgresql://u:Summer/ss3cret@db.example.com:5432/x", false},
		{"postgres://u:2024/ss3cret@db.example.com:5432/x", false},
		{"postgres://u:2024/ss3cret/more@db.example.com/x?sslmode=disable", false},
		{"postgres://a/b:ss3cret@db.example.com/x", false},
		{"postgres://u:/ss3cret@/x?host=/tmp", false},
		// pgx reads a '?' or '#' before the '@' as part of the password.
		{"postgres://u:ss3?cret@db.example.com/x", true},
		{"postgres://u:ss3#cret@db.example.com/x", true},
		// An '@' in the query, or in an escaped database name, is no sign.
		{"postgres:///x?host=/tmp&user=a%40b", true},
		{"postgres://db.example.com?application_name=a/b%40c", true},
		{"postgres://db.example.com/x?application_name=a/b%40c", true},
		{"postgres://u:pa?ss3#cret@db.example.com/x?user=a%40b", true},
		// An '@' in the query must be escaped too: without user info, a
		// password's '/' may have ended the host (below); with a '?'
		// before it, pgx reads the query up to it as the user info.
		{"postgres:///x?host=/tmp&user=a@b", false},
		{"postgres://db.example.com?application_name=a/b@c", false},
		{"postgres://db.example.com:1?user=u@srv&password=ss3cret", false},
		{"postgres://db.example.com:1?user=u@srv/db?password=ss3cret", false},
		{"postgres://127.0.0.1:1?u@x=ss3cret", false},
		{"postgres://127.0.0.1:1?u@x&ss3cret", false},
		{"postgres://db.example.com/my%40db", true},
		{"postgres://u:pw@db.example.com/my%40db", true},
		// An '@' and then a '/' in the password: pgx ended the user info
		// at the '@', the host at the '/', and took the rest for the
		// database name. A database name holding an '@' must be escaped.
		{"postgres://u:p@ss3/cret@db.example.com:5432/x", false},
		{"postgres://u:p@ss3/cret@db.example.com", false},
		{"postgres://u:p@ss3/cret@db.example.com?sslmode=disable", false},
		{"postgres://u:pw@db.example.com/my@db", false},
		{"postgres://db.example.com/my@db", false},
		// An '@' and then a '?' in the password: the text between them
		// became the host, the rest parameters.
		{"postgres://u:Xy7@kP?q3=ss3Lm@db.example.com:1/app", false},
		{"postgres://u:Tr0ub@ss3host?x=1@db.example.com/app", false},
		{"postgres://u:Tr0ub@dor?ss3cretpart@db.example.com/app", false},
		{"postgres://u:pw@db.example.com:1?connect_timeout=ss3cret@x/db", false},
		{"postgres://al@ice?app=x:ss3cret@db.example.com/x", false},
		{"postgres://u:pw@[ss3?cret]/two@db.example.com/app", false},
		// A '?' and then a '/' in the password, with no '@' before them.
		{"postgres://u:p?a/ss3cret@db.example.com/x", false},
		{"postgres://u:1234?a/ss3cret@db.example.com/x", false},
		// With user info, an '@' in a parameter must be escaped too;
		// without it, an '@' in a value is a value.
		{"postgres://u:pw@db.example.com/x?application_name=a@b", false},
		{"postgres://u:pw@db.example.com/x?application_name=a%40b", true},
		{"postgres://db.example.com/x?user=a@b&application_name=c@d", false},
		{"postgres://db.example.com/x?user=a%40b&application_name=c%40d", true},
		// A '/' and then a '?' and a pair, or a ',', in the password.
		{"postgres://app:2024/ss3cret?x=1@db.example.com/x", false},
		{"postgres://localhost:1?ss3cret=a/b@db.example.com/x", false},
		{"postgres://app:/x?ss3cret&a=b@db.example.com/x", false},
		{"postgres://app:1,ss3cret?k=v/x@db.example.com/x", false},
		{"postgres://db.example.com/x?sslmode=disable&a@b=c", false},
		{"host=db.example.com dbname=my@db password=/ss3cret", true},
	} {
		err := CheckURL(tc.dsn)
		if err != nil && !strings.Contains(err.Error(), "write a '/' in the user name or password as %2F") {
			t.Errorf("CheckURL(%q) = %v, want the advice to write '/' as %%2F", tc.dsn, err)
		}
		if err == nil {
			cfg, perr := pgconn.ParseConfig(tc.dsn)
			if perr != nil {
				t.Fatalf("ParseConfig(%q): %v", tc.dsn, perr)
			}
			err = CheckHosts(cfg)
		}
		if (err == nil) != tc.ok {
			t.Errorf("CheckURL, CheckHosts(%q) = %v, want ok %v", tc.dsn, err, tc.ok)
		}
		if err != nil && strings.Contains(err.Error(), "ss3") {
			t.Errorf("CheckURL, CheckHosts(%q) = %v: shows the password", tc.dsn, err)
		}
	}
}
