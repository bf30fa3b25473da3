// Command pgrun runs a command against a throwaway PostgreSQL cluster: it
// starts one (internal/pgcluster), runs the command with DATABASE_URL set
// to the cluster's postgres database, stops the cluster and exits as the
// command did. CI runs the tests of bench/river, a module of its own that
// starts no server, under it, so that their database tests run rather
// than skip:
//
//	go build -o /tmp/pgrun ./internal/pgcluster/pgrun
//	(cd bench/river && /tmp/pgrun go test -race ./...)
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"syscall"
	"time"

	"github.com/bellhopq/bellhop/internal/pgcluster"
)

func main() {
	os.Exit(run(os.Args[1:]))
}

// run starts the cluster, runs args and returns the exit status to use.
func run(args []string) int {
	if len(args) == 0 {
		fmt.Fprintln(os.Stderr, "usage: pgrun COMMAND [ARG...]")
		return 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// fsync off, as the test harness runs its clusters: these are tests,
	// not benchmarks.
	c, err := pgcluster.Start(ctx, pgcluster.Options{Settings: map[string]string{"fsync": "off", "max_connections": "200"}})
	if err != nil {
		fmt.Fprintf(os.Stderr, "pgrun: starting PostgreSQL: %v\n", err)
		return 1
	}
	defer func() {
		if err := c.Stop(); err != nil {
			fmt.Fprintf(os.Stderr, "pgrun: stopping PostgreSQL: %v\n", err)
		}
	}()
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.Env = append(os.Environ(), "DATABASE_URL="+c.ConnString("postgres"))
	// An interrupt reaches the command as well (same process group); pgrun
	// waits for it, then stops the cluster.
	signal.Ignore(syscall.SIGINT, syscall.SIGTERM)
	err = cmd.Run()
	var exit *exec.ExitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &exit):
		if code := exit.ExitCode(); code > 0 {
			return code
		}
		return 1
	default:
		fmt.Fprintf(os.Stderr, "pgrun: %v\n", err)
		return 1
	}
}
