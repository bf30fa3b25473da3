package pgdsn

import (
	"errors"
	"fmt"
	"net/url"
	"strings"
	"testing"

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
		{dsn: "postgres://u:123?S3CRET@host/db", want: "postgres://u:xxxxx@host/db"},
		{dsn: "postgres://u@host/db?password=S3CRET", want: "postgres://u@host/db?password=xxxxx"},
		{dsn: "postgres://host/db?sslmode=disable&password=S3CRET&user=u", want: "postgres://host/db?sslmode=disable&password=xxxxx&user=u"},
		{dsn: "postgres://host/db?sslpassword=S3CRET", want: "postgres://host/db?sslpassword=xxxxx"},
		{dsn: "postgres://host/db?pass%77ord=S3CRET", want: "postgres://host/db?pass%77ord=xxxxx"},
		{dsn: "postgres://host/db?pa%zzss=S3CRET", want: "postgres://host/db?pa%zzss=xxxxx"},
		{dsn: "postgres://host/db?password=S3C=RET", want: "postgres://host/db?password=xxxxx", secret: "RET"},
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
			err = fmt.Errorf("failed to connect to `host=%s`: hostname resolving error", strings.SplitN(dsn, "@", 2)[1])
		}
		if red := RedactError(err, dsn); strings.Contains(red.Error(), "S3CRET") {
			t.Errorf("RedactError(%q) for %q shows part of the password", red, dsn)
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
