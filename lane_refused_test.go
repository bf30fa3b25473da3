package bellhop

import (
	"context"
	"errors"
	"fmt"
	"io"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bellhopq/bellhop/internal/pgtest"
)

// TestRefused: which failed claims hold back the passes that
// notifications ask for (refusedWait): errors the server answered that
// last until their cause is mended, not those of a server starting up,
// full or cancelling, nor a connection that could not be made (a
// ConnectError carries the server's FATAL answer: the review of this
// change found 57P03 "starting up" counted as a refusal) or was lost.
func TestRefused(t *testing.T) {
	cfg, err := pgx.ParseConfig(pgtest.ConnString(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.Database = "bellhop_no_such_database"
	_, connectErr := pgx.ConnectConfig(context.Background(), cfg)
	var pgErr *pgconn.PgError
	if !errors.As(connectErr, &pgErr) || pgErr.Code != "3D000" {
		t.Fatalf("connecting to a database that does not exist: %v, want a ConnectError with SQLSTATE 3D000", connectErr)
	}
	answered := func(code string) error {
		return fmt.Errorf("claim: %w", &pgconn.PgError{Severity: "ERROR", SeverityUnlocalized: "ERROR", Code: code})
	}
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"permission denied (42501)", answered("42501"), true},
		{"a trigger's exception (P0001)", answered("P0001"), true},
		{"a check constraint (23514)", answered("23514"), true},
		{"undefined function (42883)", answered("42883"), true},
		{"deadlock (40P01)", answered("40P01"), false},
		{"lock not available (55P03)", answered("55P03"), false},
		{"statement timeout (57014)", answered("57014"), false},
		{"too many connections (53300)", answered("53300"), false},
		{"starting up (57P03)", answered("57P03"), false},
		{"session ended (FATAL 57P01)", fmt.Errorf("claim: %w", &pgconn.PgError{Severity: "FATAL", SeverityUnlocalized: "FATAL", Code: "57P01"}), false},
		{"a connect the server refused (3D000)", connectErr, false},
		{"connection broke", io.ErrUnexpectedEOF, false},
		{"no answer in time", context.DeadlineExceeded, false},
	} {
		if got := refused(tc.err); got != tc.want {
			t.Errorf("%s: refused = %t, want %t", tc.name, got, tc.want)
		}
	}
}
