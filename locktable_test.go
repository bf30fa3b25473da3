package bellhop

import (
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

// TestLockTableFullOnlyForLocks: lockTableFull explains a full lock
// table, which PostgreSQL reports as 53200 "out of shared memory" with a
// hint naming max_locks_per_transaction, and nothing else of that code:
// the server out of memory, or out of predicate locks (a serializable
// transaction), would have been told to raise max_locks_per_transaction.
func TestLockTableFullOnlyForLocks(t *testing.T) {
	for _, tc := range []struct {
		name    string
		err     error
		explain bool
	}{
		{"lock table full", &pgconn.PgError{Code: "53200", Message: "out of shared memory",
			Hint: "You might need to increase max_locks_per_transaction."}, true},
		{"predicate locks", &pgconn.PgError{Code: "53200", Message: "out of shared memory",
			Hint: "You might need to increase max_pred_locks_per_transaction."}, false},
		{"out of memory", &pgconn.PgError{Code: "53200", Message: "out of memory", Detail: "Failed on request of size 8192."}, false},
		{"another error", errors.New("connection refused"), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := lockTableFull(tc.err, []string{"a", "b", "a"})
			if !errors.Is(got, tc.err) {
				t.Fatalf("lockTableFull lost the error: %v", got)
			}
			said := strings.Contains(got.Error(), "lock table is full")
			if said != tc.explain {
				t.Errorf("lockTableFull(%v) = %q: explained %t, want %t", tc.err, got, said, tc.explain)
			}
			if tc.explain && !strings.Contains(got.Error(), "2 in this call") {
				t.Errorf("the explanation does not count the 2 distinct queues: %v", got)
			}
		})
	}
}
