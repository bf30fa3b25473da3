package validate_test

import (
	"strings"
	"testing"

	"github.com/bellhopq/bellhop/internal/validate"
)

// TestNameErrorsHidePasswords: a connection string given where an app,
// principal or queue name belongs (`bellhop app create
// postgres://u:pw@h/db`) was quoted whole, password and all, in the
// error; other bad names are still quoted as typed.
func TestNameErrorsHidePasswords(t *testing.T) {
	t.Parallel()
	checks := map[string]func(string) error{
		"app":       func(s string) error { return validate.Name("app", s) },
		"principal": func(s string) error { return validate.Name("principal", s) },
		"queue":     validate.QueueName,
	}
	for _, tc := range []struct{ name, want string }{
		{"postgres://u:S3CRET@h/db", `"postgres://u:xxxxx@h/db"`},
		{"PostgreSQL://u:S3CRET@h/db?sslmode=disable", `"PostgreSQL://u:xxxxx@h/db?sslmode=disable"`},
		{"host=h password=S3CRET dbname=d", `"host=h password=xxxxx dbname=d"`},
		{"https://u:S3CRET@h/x", `"https://xxxxx@h/x"`},
		{"u:S3CRET@h", "(not shown: it may carry credentials)"},
		{"bad name", `"bad name"`},
		{"dry=run", `"dry=run"`},
		{strings.Repeat("a", 70) + " ", `"` + strings.Repeat("a", 64) + `"… (71 bytes)`},
	} {
		for kind, check := range checks {
			err := check(tc.name)
			if err == nil {
				t.Fatalf("%s name %q: accepted", kind, tc.name)
			}
			if msg := err.Error(); !strings.Contains(msg, tc.want) || strings.Contains(msg, "S3CRET") {
				t.Errorf("%s name %q: error %q, want it to show %s", kind, tc.name, msg, tc.want)
			}
		}
	}
}
