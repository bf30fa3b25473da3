package pgdsn

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// TestRedact: no form of connection string, well-formed or not, keeps its
// password, and the rest stays readable where its structure is clear.
func TestRedact(t *testing.T) {
	tests := []struct {
		dsn    string
		want   string // exactly, or "" to check only that no secret is left
		secret string // must not appear; "" means S3CRET
	}{
		{dsn: "postgres://u:S3CRET@host:5432/db?sslmode=disable", want: "postgres://u:xxxxx@host:5432/db?sslmode=disable"},
		{dsn: "postgresql://u:S3CRET@host/db", want: "postgresql://u:xxxxx@host/db"},
		{dsn: "postgres://u:S3CRET%zz@host/db", want: "postgres://u:xxxxx@host/db"},
		{dsn: "postgres://u:S3CRET@ho st/db", want: "postgres://u:xxxxx@ho st/db"},
		{dsn: "postgres://u:S3/CR?ET@host/db", want: "postgres://u:xxxxx@host/db", secret: "CR?ET"},
		{dsn: "postgres://u:p@S3CRET@host/db", want: "postgres://u:xxxxx@host/db"},
		{dsn: "postgres://u:/S3CRET@host/db", want: "postgres://u:xxxxx@host/db"},
		{dsn: "postgres://u:2024/S3CRET@host:5432/db", want: "postgres://u:xxxxx@host:5432/db"},
		{dsn: "postgres://u:123?S3CRET@host/db", want: "postgres://u:xxxxx@host/db"},
		{dsn: "postgres://u@host/db?password=S3CRET", want: "postgres://u@host/db?password=xxxxx"},
		{dsn: "postgres://host/db?sslmode=disable&password=S3CRET&user=u", want: "postgres://host/db?sslmode=disable&password=xxxxx&user=u"},
		{dsn: "postgres://host/db?sslpassword=S3CRET", want: "postgres://host/db?sslpassword=xxxxx"},
		{dsn: "postgres://host/db?pass%77ord=S3CRET", want: "postgres://host/db?pass%77ord=xxxxx"},
		{dsn: "postgres://host/db?pa%zzss=S3CRET", want: "postgres://host/db?xxxxx"},
		{dsn: "postgres://host/db?password=S3C=RET", want: "postgres://host/db?xxxxx", secret: "RET"},
		{dsn: "postgres://host/db?password=Summer&S3CRET&connect_timeout=2", want: "postgres://host/db?password=xxxxx&xxxxx&connect_timeout=2"},
		{dsn: "postgres://host/db?sslpassword=Summer&S3CRET&x&sslmode=disable", want: "postgres://host/db?sslpassword=xxxxx&xxxxx&xxxxx&sslmode=disable"},
		{dsn: "postgres://host/db?sslmode=disable&S3CRET", want: "postgres://host/db?sslmode=disable&xxxxx"},
		{dsn: "postgres://app:S3CRET?pw", want: "postgres://app:xxxxx", secret: "pw"},
		{dsn: "postgres://app:S3CRET", want: "postgres://app:xxxxx"},
		{dsn: "postgres://app:Summer/S3CRET", want: "postgres://app:xxxxx"},
		{dsn: "postgres://app:Summer?S3CRET=x", want: "postgres://app:xxxxx"},
		{dsn: "postgres://app:Sum,S3CRET", want: "postgres://app:xxxxx"},
		{dsn: "postgres://app:12345678S3CRET", want: "postgres://app:xxxxx"},
		{dsn: "postgres://h1:5432,app:S3CRET?connect_timeout=2", want: "postgres://h1:5432,app:xxxxx"},
		{dsn: "postgres://[::1]:5432/db", want: "postgres://[::1]:5432/db"},
		{dsn: "postgres://h1:5432,h2:,h3/db", want: "postgres://h1:5432,h2:,h3/db"},
		{dsn: "postgres://host:%35432/db", want: "postgres://host:%35432/db"},
		{dsn: "postgres://host/db?", want: "postgres://host/db?"},
		{dsn: "postgres://host/db?sslmode=disable&", want: "postgres://host/db?sslmode=disable&"},
		{dsn: "postgres://host/db?password=Summer&S3CRET=x=y&connect_timeout=2", want: "postgres://host/db?password=xxxxx&xxxxx&connect_timeout=2"},
		{dsn: "postgres://host/db?password=Summer&S3%CRET=x", want: "postgres://host/db?password=xxxxx&xxxxx"},
		{dsn: "POSTGRES://u:S3CRET@host/db", want: "POSTGRES://u:xxxxx@host/db"},
		{dsn: "  postgres://u:S3CRET@host/db", want: "  postgres://u:xxxxx@host/db"},
		{dsn: "postgres://u@host/db", want: "postgres://u@host/db"},
		{dsn: "host=x password=S3CRET port=5", want: "host=x password=xxxxx port=5"},
		{dsn: "host=x password = S3CRETpw port=abc", want: "host=x password = xxxxx port=abc"},
		{dsn: "host=x password=\tS3CRET", want: "host=x password=\txxxxx"},
		{dsn: "host=x password='S3 CRET' port=5", want: "host=x password=xxxxx port=5", secret: "CRET"},
		{dsn: "host=x password = 'S3\\' CRET' port=5", want: "host=x password = xxxxx port=5", secret: "CRET"},
		{dsn: "host=x password=S3\\ CRET port=5", want: "host=x password=xxxxx port=5", secret: "CRET"},
		{dsn: "host=x password='S3CRET port=5", want: "host=x password=xxxxx"},
		{dsn: "host=x sslpassword=S3CRET", want: "host=x sslpassword=xxxxx"},
		{dsn: "host=x password S3CRET port=5", want: "host=x xxxxx"},
		{dsn: "host=x S3CRET", want: "host=x xxxxx"},
		{dsn: "POSTGRES://u:S3CRET@h/db?sslmode=x", want: "POSTGRES://u:xxxxx@h/db?sslmode=x"},
		{dsn: "host=x user=u:S3CRET@h/db?sslmode=disable port=5", want: "host=x user=u:S3CRET@h/db?sslmode=disable port=5", secret: "-"},
		{dsn: "host=/tmp port=5432 dbname=db", want: "host=/tmp port=5432 dbname=db"},
		{dsn: "", want: ""},
	}
	for _, tc := range tests {
		got := Redact(tc.dsn)
		if got != tc.want {
			t.Errorf("Redact(%q) = %q, want %q", tc.dsn, got, tc.want)
		}
		secret := tc.secret
		if secret == "" {
			secret = "S3CRET"
		}
		if secret != "-" && strings.Contains(got, secret) {
			t.Errorf("Redact(%q) = %q keeps %q", tc.dsn, got, secret)
		}
	}
}

// TestRedactError: errors from parsing a connection string, pgx's and
// net/url's, lose the password wherever they quote it, and still unwrap.
func TestRedactError(t *testing.T) {
	for _, dsn := range []string{
		"host=x password = S3CRETpw port=abc",
		"host=x password =S3CRETpw port=abc",
		"host=x password='S3CRETpw x' port=abc",
		"host=x password S3CRETpw",
		"postgres://u:S3CRETpw%zz@host/db",
		"postgres://u:S3CRETpw@host:abc/db",
		"postgres://u@host:abc/db?password=S3CRETpw",
		"postgres://u:S3CRETpw@ho st/db",
		"postgres://u:S3%43RETpw@host:abc/db",
		"POSTGRES://u:S3CRETpw@h/db",
	} {
		_, err := pgconn.ParseConfig(dsn)
		if err == nil {
			t.Fatalf("ParseConfig(%q) succeeded", dsn)
		}
		red := RedactError(err, dsn)
		if strings.Contains(red.Error(), "S3CRETpw") || strings.Contains(red.Error(), "S3CRET") {
			t.Errorf("RedactError(ParseConfig(%q)) = %q", dsn, red)
		}
		var pce *pgconn.ParseConfigError
		if !errors.As(red, &pce) {
			t.Errorf("RedactError(ParseConfig(%q)) does not unwrap to a *pgconn.ParseConfigError", dsn)
		}
		if !strings.Contains(red.Error(), "cannot parse") {
			t.Errorf("RedactError(ParseConfig(%q)) = %q lost pgx's reason", dsn, red)
		}
	}
	for _, dsn := range []string{"postgres://u:S3CRET%zz@host/db", "postgres://u:S3CRET@ho st/db", "postgres://u:S3CRET@host:x/db"} {
		_, err := url.Parse(dsn)
		red := RedactError(err, dsn)
		if strings.Contains(red.Error(), "S3CRET") || strings.Contains(red.Error(), "%zz") {
			t.Errorf("RedactError(url.Parse(%q)) = %q", dsn, red)
		}
		var ue *url.Error
		if !errors.As(red, &ue) {
			t.Errorf("RedactError(url.Parse(%q)) does not unwrap to a *url.Error", dsn)
		}
	}
	// A password with an unescaped '@': pgx ends the user info at the
	// first '@' and quotes the rest as part of the host, or of a bad
	// escape.
	for _, dsn := range []string{"postgres://u:P@S3CRETpw@localhost:1/db", "postgres://u:P@ss%S3CRETpw@localhost:1/db"} {
		_, err := pgconn.ParseConfig(dsn)
		if err == nil {
			// The host "S3CRETpw@localhost" does not resolve: pgx's
			// error quotes it.
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			_, err = pgconn.Connect(ctx, dsn)
			cancel()
			if err == nil || !strings.Contains(err.Error(), "S3CRETpw@localhost") {
				t.Fatalf("connecting with %q: %v, want an error that names the host", dsn, err)
			}
			err = fmt.Errorf("connect: %w", err)
		}
		if red := RedactError(err, dsn); strings.Contains(red.Error(), "S3CRET") {
			t.Errorf("RedactError(%q) for %q shows part of the password", red, dsn)
		}
	}
	// A password with an unescaped '/': pgx ends the host at it, and the
	// rest of the password, up to the real host and database, is the
	// database name that its connect error prints (CheckURL refuses such
	// a string first; this is the second line of defence). The query
	// sends the connection to a socket directory that does not exist.
	for _, tc := range []struct{ dsn, first string }{
		{"postgres://app:/S3CRETpw@db.internal:5432/bellhop?host=/nonexistent&port=1", ""},
		{"postgres://app:Summer/S3CRETpw@db.internal:5432/bellhop?host=/nonexistent&port=1", "Summer"},
		{"postgres://app:2024/S3CRETpw@db.internal:5432/bellhop?host=/nonexistent&port=1", "2024"},
		{"postgres://app:Summer/S3CRETpw@db.internal:5432/bellhop", "Summer"},
	} {
		_, err := pgconn.ParseConfig(tc.dsn)
		if err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			_, err = pgconn.Connect(ctx, tc.dsn)
			cancel()
			if err == nil || !strings.Contains(err.Error(), "database=S3CRETpw@db.internal:5432/bellhop") {
				t.Fatalf("connecting with %q: %v, want an error that names the database", tc.dsn, err)
			}
		}
		red := RedactError(fmt.Errorf("connect: %w", err), tc.dsn).Error()
		if strings.Contains(red, "S3CRET") || tc.first != "" && strings.Contains(red, tc.first) {
			t.Errorf("RedactError(%q) for %q shows part of the password", red, tc.dsn)
		}
	}
	if RedactError(nil, "x") != nil {
		t.Error("RedactError(nil) is not nil")
	}
}

// TestRewriteErrorsRedacted: WithDatabase and WithUser quote a connection
// string they cannot parse without its password.
func TestRewriteErrorsRedacted(t *testing.T) {
	for _, dsn := range []string{
		"postgres://u:S3CRET%zz@host/db",
		"postgres://u:S3CRET@ho st/db",
		"host=x password = S3CRET port=abc",
		"host=x password='S3CRET",
	} {
		for name, f := range map[string]func(string, string) (string, error){"WithDatabase": WithDatabase, "WithUser": WithUser} {
			_, err := f(dsn, "x")
			if err == nil {
				t.Errorf("%s(%q) succeeded", name, dsn)
				continue
			}
			if strings.Contains(err.Error(), "S3CRET") {
				t.Errorf("%s(%q): %v", name, dsn, err)
			}
		}
	}
}

// TestRedactErrorKeepsWording: with docker-compose.yml's connection
// string, whose password is also the database's name and the command's,
// the database and user names that the errors print on purpose and the
// wording around them stay readable; a password that a server echoes
// elsewhere is still hidden. Every copy of the password used to be
// masked: database "xxxxx" does not exist, run `xxxxx migrate`.
func TestRedactErrorKeepsWording(t *testing.T) {
	const compose = "postgres://postgres:bellhop@db:5432/bellhop"
	// A real connect error, which names the user and the database: to a
	// socket directory that does not exist, so that no server is needed.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, connErr := pgconn.Connect(ctx, "postgres://postgres:bellhop@/bellhop?host=/nonexistent&port=5432")
	if connErr == nil {
		t.Fatal("connecting to /nonexistent succeeded")
	}
	noDatabase := &pgconn.PgError{Severity: "FATAL", Code: "3D000", Message: `database "bellhop" does not exist`}
	tests := []struct {
		name     string
		dsn      string
		err      error
		want     string // exactly
		password string // must not appear, "" for none
	}{
		{"our wording", compose, fmt.Errorf("check schema: %w", errors.New("database has no Bellhop schema: run `bellhop migrate`")),
			"check schema: database has no Bellhop schema: run `bellhop migrate`", ""},
		{"joined wording", compose, errors.Join(errors.New("run `bellhop migrate`"), errors.New("bellhop again")),
			"run `bellhop migrate`\nbellhop again", ""},
		{"the server names the database", compose, fmt.Errorf("connect to the database: %w", noDatabase),
			`connect to the database: FATAL: database "bellhop" does not exist (SQLSTATE 3D000)`, ""},
		{"pgx names the user and database", compose, fmt.Errorf("connect to the database: %w", connErr),
			"connect to the database: " + connErr.Error(), ""},
		// The password is the user name: printing the user prints it.
		{"password equal to the user", "postgres://postgres:postgres@db/bellhop", fmt.Errorf("connect: %w", connErr),
			"connect: " + connErr.Error(), ""},
		{"an echoed password", "postgres://postgres:S3CRETpw@db/bellhop",
			fmt.Errorf("run `bellhop migrate`: %w", &pgconn.PgError{Severity: "ERROR", Code: "22023",
				Message: `invalid value for parameter "application_name": "S3CRETpw" in database "bellhop"`}),
			"run `bellhop migrate`: ERROR: invalid value for parameter \"application_name\": \"xxxxx\" in database \"bellhop\" (SQLSTATE 22023)", "S3CRETpw"},
		// Masked wherever it is, even in an error formatted into the
		// caller's text rather than wrapped.
		{"an echoed password formatted with %v", "postgres://postgres:S3CRETpw@db/bellhop",
			fmt.Errorf("connect: %v", &pgconn.PgError{Severity: "ERROR", Code: "22023",
				Message: `invalid value for parameter "application_name": "S3CRETpw"`}),
			"connect: ERROR: invalid value for parameter \"application_name\": \"xxxxx\" (SQLSTATE 22023)", "S3CRETpw"},
		// A password within the database's name is shown with it (its
		// other copies are hidden), as one equal to the name would be.
		{"a password within a name", "postgres://postgres:hop@db/bellhop",
			fmt.Errorf("connect: %w", &pgconn.PgError{Severity: "FATAL", Code: "28000", Message: `database "bellhop" said hop, hop`}),
			`connect: FATAL: database "bellhop" said xxxxx, xxxxx (SQLSTATE 28000)`, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			red := RedactError(tc.err, tc.dsn)
			if red.Error() != tc.want {
				t.Errorf("RedactError = %q\nwant          %q", red, tc.want)
			}
			if tc.password != "" && strings.Contains(red.Error(), tc.password) {
				t.Errorf("RedactError = %q shows the password", red)
			}
			if !errors.Is(red, tc.err) {
				t.Errorf("RedactError does not unwrap to the error")
			}
		})
	}
	if !strings.Contains(connErr.Error(), "user=postgres database=bellhop") {
		t.Errorf("pgx's connect error %q does not name the user and database as the test expects", connErr)
	}
}
