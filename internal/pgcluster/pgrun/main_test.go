package main

import (
	"context"
	"os"
	"testing"

	"github.com/jackc/pgx/v5"
)

// TestRunGivesTheCommandADatabase: the command runs with DATABASE_URL
// naming a server that answers, and pgrun exits as the command did. The
// command is this test binary again, as TestQueryDatabase.
func TestRunGivesTheCommandADatabase(t *testing.T) {
	self := []string{os.Args[0], "-test.run=^TestQueryDatabase$"}
	for _, tc := range []struct {
		name string
		args []string
		want int
	}{
		{"server answers", self, 0},
		{"exit status kept", []string{"sh", "-c", `test -n "$DATABASE_URL" && exit 3`}, 3},
		{"no command", nil, 2},
		{"command not found", []string{"/nonexistent/pgrun-test"}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("PGRUN_TEST_QUERY", "1")
			if got := run(tc.args); got != tc.want {
				t.Errorf("run(%q) = %d, want %d", tc.args, got, tc.want)
			}
		})
	}
}

// TestQueryDatabase is the command TestRunGivesTheCommandADatabase runs:
// it fails unless DATABASE_URL's server answers a query. Run directly, it
// has nothing to check.
func TestQueryDatabase(t *testing.T) {
	if os.Getenv("PGRUN_TEST_QUERY") == "" {
		return
	}
	conn, err := pgx.Connect(context.Background(), os.Getenv("DATABASE_URL"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var n int
	if err := conn.QueryRow(context.Background(), "SELECT 41 + 1").Scan(&n); err != nil || n != 42 {
		t.Fatalf("SELECT 41 + 1: %d, %v", n, err)
	}
}
