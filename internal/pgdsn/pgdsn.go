// Package pgdsn rewrites PostgreSQL connection strings, in URL or
// keyword/value form, for the tools that create databases on a server: the
// test harness and the benchmark.
package pgdsn

import (
	"fmt"
	"net/url"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// WithDatabase returns dsn pointing at dbname instead of its own database,
// with everything else unchanged.
func WithDatabase(dsn, dbname string) (string, error) {
	// pgx lets a dbname/database query parameter override the path.
	return rewrite(dsn, "dbname", dbname, func(u *url.URL) {
		u.Path, u.RawPath = "/"+dbname, ""
	}, "dbname", "database")
}

// WithUser returns dsn connecting as user instead of its own user, with
// everything else unchanged (a password in the DSN is kept).
func WithUser(dsn, user string) (string, error) {
	return rewrite(dsn, "user", user, func(u *url.URL) {
		if pw, ok := u.User.Password(); ok {
			u.User = url.UserPassword(user, pw)
		} else {
			u.User = url.User(user)
		}
	}, "user")
}

// rewrite sets one connection parameter: in a URL with edit, dropping the
// query parameters named in drop that would override it; in keyword/value
// form by appending keyword=value, since the last occurrence wins.
func rewrite(dsn, keyword, value string, edit func(*url.URL), drop ...string) (string, error) {
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		u, err := url.Parse(dsn)
		if err != nil {
			return "", fmt.Errorf("parse %q: %w", Redact(dsn), err)
		}
		edit(u)
		q := u.Query()
		for _, k := range drop {
			q.Del(k)
		}
		u.RawQuery = q.Encode()
		return u.String(), nil
	}
	if _, err := pgconn.ParseConfig(dsn); err != nil {
		return "", fmt.Errorf("parse %q: %w", Redact(dsn), err)
	}
	return strings.TrimSpace(dsn + " " + keyword + "=" + quoteValue(value)), nil
}

func quoteValue(v string) string {
	if v != "" && !strings.ContainsAny(v, " \t\n\r\v\f'\\") {
		return v
	}
	return "'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(v) + "'"
}

// Redact hides a connection string's password, for error messages.
func Redact(dsn string) string {
	if u, err := url.Parse(dsn); err == nil && u.User != nil {
		return u.Redacted()
	}
	if strings.Contains(dsn, "password") {
		return "<dsn with password>"
	}
	return dsn
}
