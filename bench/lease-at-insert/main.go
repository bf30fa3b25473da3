// Command lease-at-insert measures what leasing a message at INSERT time
// would save an idle dispatcher, against Bellhop's path today, in one
// interleaved run. See docs/lease-at-insert.md for the design it prices.
//
//	go run ./bench/lease-at-insert -database-url postgres://...
//
// Without -database-url it starts a throwaway cluster from the local
// PostgreSQL binaries, with the settings bellhop-bench uses (durability at
// PostgreSQL's defaults). A given database must be a scratch one: the
// command migrates it, installs prototype.sql (a variant of the notify
// trigger and an offers table) and removes the prototype when it ends.
//
// One producer sends one message every -interval with Client.Enqueue. A
// dispatcher stand-in LISTENs on its own connection and, per message:
//   - "claim" (today): hears "q:", runs claim.ClaimPass on a pool with
//     synchronous_commit off, as a lane does;
//   - "lease" (prototype): has made an offer before the message was sent
//     (off the timed path), and hears "l:" with the lease and payload.
//
// Each message is timed from just before Enqueue to the moment the
// stand-in holds its lease; the lease is then checked by deleting the row
// by id and claim token, which must find it. Blocks of -n messages
// alternate between the two paths, -rounds times.
package main

import (
	"context"
	_ "embed"
	"errors"
	"flag"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/claim"
	"github.com/bellhopq/bellhop/internal/pgcluster"
	"github.com/bellhopq/bellhop/migrations"
)

// variants are the prototypes: their SQL and the triggers that replace
// Bellhop's notify trigger while they are measured.
var variants = map[string]struct {
	sql      string
	triggers []string
}{
	"update": {prototypeSQL, []string{"proto_lease"}},
	"before": {prototypeBeforeSQL, []string{"proto_lease_b", "proto_lease"}},
}

var (
	//go:embed prototype.sql
	prototypeSQL string
	//go:embed prototype_before.sql
	prototypeBeforeSQL string
)

const (
	appName = "lease-probe"
	queue   = "q"
)

const teardownSQL = `
ALTER TABLE queue_messages ENABLE TRIGGER queue_messages_notify;
DROP TRIGGER IF EXISTS proto_lease ON queue_messages;
DROP TRIGGER IF EXISTS proto_lease_b ON queue_messages;
DROP FUNCTION IF EXISTS proto_lease_notify();
DROP FUNCTION IF EXISTS proto_lease_before();
DROP TABLE IF EXISTS proto_lease_offer;`

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "lease-at-insert:", err)
		os.Exit(1)
	}
}

type mode int

const (
	modeClaim mode = iota
	modeLease
)

func (m mode) String() string { return [...]string{"claim (today)", "lease at insert"}[m] }

// lease is what the stand-in holds once a message is its own.
type lease struct {
	at    time.Time
	mode  mode
	id    uuid.UUID
	token uuid.UUID
	err   error
}

func run(args []string) error {
	fs := flag.NewFlagSet("lease-at-insert", flag.ContinueOnError)
	dsn := fs.String("database-url", os.Getenv("DATABASE_URL"), "scratch database to migrate and use (default $DATABASE_URL; none: a throwaway cluster)")
	n := fs.Int("n", 300, "messages per block")
	rounds := fs.Int("rounds", 3, "rounds of one block per path")
	interval := fs.Duration("interval", 10*time.Millisecond, "pause between messages")
	variantName := fs.String("variant", "update", "prototype: update (prototype.sql: the trigger UPDATEs the new row) or before (prototype_before.sql: a BEFORE row trigger writes the lease)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	v, ok := variants[*variantName]
	if !ok {
		return fmt.Errorf("unknown -variant %q: want update or before", *variantName)
	}
	if *n < 20 || *rounds < 1 || *interval <= 0 {
		return errors.New("-n must be at least 20, -rounds at least 1 and -interval positive")
	}
	ctx := context.Background()
	if *dsn == "" {
		c, err := pgcluster.Start(ctx, pgcluster.Options{Settings: map[string]string{"shared_preload_libraries": "pg_stat_statements"}})
		if err != nil {
			return fmt.Errorf("start a throwaway cluster: %w", err)
		}
		defer c.Stop()
		*dsn = c.ConnString("postgres")
	}

	conn, err := pgx.Connect(ctx, *dsn)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	if err := migrations.Migrate(ctx, conn); err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, teardownSQL); err != nil {
		return fmt.Errorf("remove an earlier prototype: %w", err)
	}
	if _, err := conn.Exec(ctx, v.sql); err != nil {
		return fmt.Errorf("install the %s prototype: %w", *variantName, err)
	}
	defer func() {
		if _, err := conn.Exec(context.Background(), teardownSQL); err != nil {
			fmt.Fprintln(os.Stderr, "lease-at-insert: remove the prototype:", err)
		}
	}()
	var appID uuid.UUID
	err = conn.QueryRow(ctx, `INSERT INTO apps (name) VALUES ($1)
		ON CONFLICT (name) DO UPDATE SET name = EXCLUDED.name RETURNING id`, appName).Scan(&appID)
	if err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, "DELETE FROM queue_messages WHERE app_id = $1", appID); err != nil {
		return err
	}

	prod, err := pgxpool.New(ctx, *dsn)
	if err != nil {
		return err
	}
	defer prod.Close()
	dcfg, err := pgxpool.ParseConfig(*dsn)
	if err != nil {
		return err
	}
	dcfg.ConnConfig.RuntimeParams["synchronous_commit"] = "off" // as bellhop.NewDispatcher sets it
	disp, err := pgxpool.NewWithConfig(ctx, dcfg)
	if err != nil {
		return err
	}
	defer disp.Close()
	listen, err := pgx.Connect(ctx, *dsn)
	if err != nil {
		return err
	}
	defer listen.Close(context.Background())
	if _, err := listen.Exec(ctx, "LISTEN bellhop"); err != nil {
		return err
	}

	lctx, stop := context.WithCancel(ctx)
	defer stop()
	got := make(chan lease, 1)
	target := claim.Target{Source: claim.Queue, AppID: appID, Queue: queue}
	go hear(lctx, listen, disp, target, got)

	client := bellhop.NewClient(prod)
	type sample struct{ enqueue, held []time.Duration }
	results := make([][2]sample, *rounds)
	for r := range *rounds {
		for _, m := range []mode{modeClaim, modeLease} {
			if err := use(ctx, conn, m, v.triggers); err != nil {
				return err
			}
			s := &results[r][m]
			for i := range *n {
				if m == modeLease {
					if _, err := disp.Exec(ctx, `INSERT INTO proto_lease_offer
						VALUES (gen_random_uuid(), $1, $2, now() + interval '1 minute')`, appID, queue); err != nil {
						return err
					}
				}
				time.Sleep(*interval)
				t0 := time.Now()
				if _, err := client.Enqueue(ctx, appName, queue, []byte(fmt.Sprintf(`{"i":%d}`, i)), bellhop.EnqueueOptions{}); err != nil {
					return err
				}
				t1 := time.Now()
				var l lease
				select {
				case l = <-got:
				case <-time.After(5 * time.Second):
					return fmt.Errorf("%s: message %d not heard of within 5s", m, i)
				}
				if l.err != nil {
					return l.err
				}
				if l.mode != m {
					return fmt.Errorf("%s: message %d came by the other path", m, i)
				}
				tag, err := disp.Exec(ctx, "DELETE FROM queue_messages WHERE id = $1 AND claim_token = $2", l.id, l.token)
				if err != nil {
					return err
				}
				if tag.RowsAffected() != 1 {
					return fmt.Errorf("%s: message %d: lease %s not found in the table", m, i, l.token)
				}
				if i >= *n/10 { // warm-up
					s.enqueue = append(s.enqueue, t1.Sub(t0))
					s.held = append(s.held, l.at.Sub(t0))
				}
			}
		}
	}
	if err := use(ctx, conn, modeClaim, v.triggers); err != nil {
		return err
	}

	fmt.Printf("prototype %q; %d rounds of %d messages per path, one every %s; µs, median of the rounds' percentiles (min – max)\n\n", *variantName, *rounds, *n, *interval)
	fmt.Println("| Path | Measure | p50 | p90 | p99 |")
	fmt.Println("|---|---|--:|--:|--:|")
	var p50 [2]float64
	for _, m := range []mode{modeClaim, modeLease} {
		for _, what := range []string{"Enqueue call", "Enqueue → lease held"} {
			row := fmt.Sprintf("| %s | %s |", m, what)
			for _, q := range []float64{0.50, 0.90, 0.99} {
				var per []float64
				for r := range results {
					xs := results[r][m].held
					if what == "Enqueue call" {
						xs = results[r][m].enqueue
					}
					per = append(per, pct(xs, q))
				}
				slices.Sort(per)
				med := per[len(per)/2]
				if q == 0.50 && what != "Enqueue call" {
					p50[m] = med
				}
				row += fmt.Sprintf(" %.0f (%.0f – %.0f) |", med, per[0], per[len(per)-1])
			}
			fmt.Println(row)
		}
	}
	fmt.Printf("\nlease / claim, p50 to lease held: %.2f\n", p50[modeLease]/p50[modeClaim])
	return nil
}

// use switches the notify trigger between Bellhop's and the prototype's.
func use(ctx context.Context, conn *pgx.Conn, m mode, proto []string) error {
	on, off := "DISABLE", "ENABLE"
	if m == modeLease {
		on, off = "ENABLE", "DISABLE"
	}
	q := "ALTER TABLE queue_messages " + off + " TRIGGER queue_messages_notify"
	for _, t := range proto {
		q += ", " + on + " TRIGGER " + t
	}
	_, err := conn.Exec(ctx, q)
	return err
}

// hear is the dispatcher stand-in: it turns each notification about the
// queue into a held lease.
func hear(ctx context.Context, conn *pgx.Conn, db *pgxpool.Pool, t claim.Target, got chan<- lease) {
	queueNote := "q:" + t.AppID.String() + ":" + t.Queue
	for {
		note, err := conn.WaitForNotification(ctx)
		if err != nil {
			if ctx.Err() == nil {
				got <- lease{err: fmt.Errorf("listen: %w", err)}
			}
			return
		}
		switch {
		case note.Payload == queueNote:
			msgs, _, err := claim.Claim(ctx, db, t, 10)
			l := lease{at: time.Now(), mode: modeClaim, err: err}
			if err == nil && len(msgs) != 1 {
				l.err = fmt.Errorf("claim: %d messages, want 1", len(msgs))
			}
			if l.err == nil {
				l.id, l.token = msgs[0].ID, msgs[0].Token
			}
			got <- l
		case strings.HasPrefix(note.Payload, "l:"):
			// l:<token>:<id>:<attempt>:<payload>
			parts := strings.SplitN(note.Payload, ":", 5)
			l := lease{at: time.Now(), mode: modeLease}
			if len(parts) != 5 {
				l.err = fmt.Errorf("garbled lease notification %q", note.Payload)
			} else if l.token, l.err = uuid.Parse(parts[1]); l.err == nil {
				l.id, l.err = uuid.Parse(parts[2])
			}
			got <- l
		}
	}
}

// pct is the q-quantile of xs in µs (nearest rank).
func pct(xs []time.Duration, q float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	i := int(q*float64(len(s)) + 0.5)
	i = min(max(i-1, 0), len(s)-1)
	return float64(s[i].Microseconds())
}
