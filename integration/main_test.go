// Package integration runs whole dispatchers against a real PostgreSQL:
// push delivery, timers, retries, fencing, outages, crashes and several
// dispatchers sharing one database.
package integration

import (
	"os"
	"testing"

	"github.com/bellhopq/bellhop/internal/pgtest"
)

func TestMain(m *testing.M) {
	// A helper process (see TestHelperProcess) is handed its database by
	// its parent; it must not start a server of its own.
	if os.Getenv(helperEnv) != "" {
		os.Exit(m.Run())
	}
	pgtest.Main(m)
}
