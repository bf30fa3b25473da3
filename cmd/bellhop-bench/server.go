package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bellhopq/bellhop/internal/pgcluster"
	"github.com/bellhopq/bellhop/internal/pgdsn"
	"github.com/bellhopq/bellhop/migrations"
)

// server is the PostgreSQL server every scenario of a run uses: a
// throwaway cluster with default durability settings, or DATABASE_URL.
type server struct {
	cluster *pgcluster.Cluster // nil with DATABASE_URL
	// adminDSN reaches the maintenance database "postgres": over the unix
	// socket for a throwaway cluster, as given for DATABASE_URL.
	adminDSN string
	// adminTCP is the same over TCP, "" if unknown.
	adminTCP string
	template string // migrated template database
	// pss: pg_stat_statements is loaded and its view is usable from
	// adminDSN.
	pss      bool
	settings [][2]string
}

// serverSettings are the settings a throwaway cluster starts with. Only
// what a benchmark needs is set: durability stays at PostgreSQL's
// defaults (fsync, synchronous_commit, full_page_writes all on).
//
// pg_stat_statements.max is raised from its default of 5,000: a full run
// creates about a hundred databases, and the entries of those dropped stay
// until evicted; an eviction may take the idle scenario's entries and
// lower its counts (runIdle checks pg_stat_statements_info.dealloc).
func serverSettings() map[string]string {
	return map[string]string{
		"shared_preload_libraries": "pg_stat_statements",
		"pg_stat_statements.max":   "20000",
	}
}

// pssSettings are the pg_stat_statements settings that decide what the
// statement counts hold: which statements are tracked (top level or
// nested, utility commands or not) and how many entries fit before the
// least used are evicted.
var pssSettings = []string{"pg_stat_statements.track", "pg_stat_statements.track_utility", "pg_stat_statements.max"}

func startServer(ctx context.Context, databaseURL string, serverLog io.Writer) (*server, error) {
	s := &server{}
	if databaseURL != "" {
		dsn, err := pgdsn.WithDatabase(databaseURL, "postgres")
		if err != nil {
			return nil, fmt.Errorf("DATABASE_URL: %w", err)
		}
		s.adminDSN = dsn
		if tcp, _ := isTCP(dsn); tcp {
			s.adminTCP = dsn
		}
	} else {
		c, err := pgcluster.Start(ctx, pgcluster.Options{Settings: serverSettings(), TCP: true, Log: serverLog})
		if err != nil {
			return nil, err
		}
		s.cluster = c
		s.adminDSN = c.ConnString("postgres")
		s.adminTCP = c.TCPConnString("postgres")
	}
	if err := s.prepare(ctx); err != nil {
		s.close()
		return nil, err
	}
	return s, nil
}

func (s *server) prepare(ctx context.Context) error {
	conn, err := pgx.Connect(ctx, s.adminDSN)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements"); err == nil {
		_, err = conn.Exec(ctx, "SELECT count(*) FROM pg_stat_statements")
		s.pss = err == nil
	}
	for _, name := range []string{"server_version", "fsync", "synchronous_commit", "full_page_writes", "wal_sync_method",
		"shared_buffers", "max_connections", "work_mem", "max_wal_size", "checkpoint_timeout", "shared_preload_libraries"} {
		var v string
		if err := conn.QueryRow(ctx, "SELECT current_setting($1)", name).Scan(&v); err != nil {
			return fmt.Errorf("SHOW %s: %w", name, err)
		}
		s.settings = append(s.settings, [2]string{name, v})
	}
	// Recorded for any server, ours or DATABASE_URL's; without the
	// library loaded they are not defined.
	for _, name := range pssSettings {
		var v *string
		if err := conn.QueryRow(ctx, "SELECT current_setting($1, true)", name).Scan(&v); err != nil {
			return fmt.Errorf("SHOW %s: %w", name, err)
		}
		if v == nil {
			s.settings = append(s.settings, [2]string{name, "(not loaded)"})
		} else {
			s.settings = append(s.settings, [2]string{name, *v})
		}
	}
	// The template: every scenario run clones it, so runs start from the
	// same freshly migrated, empty schema and never see each other's rows,
	// dead tuples or notifications.
	s.template = "bellhop_bench_tmpl_" + randomHex(4)
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+ident(s.template)); err != nil {
		return fmt.Errorf("create template: %w", err)
	}
	dsn, err := pgdsn.WithDatabase(s.adminDSN, s.template)
	if err != nil {
		return err
	}
	tc, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return fmt.Errorf("connect to template: %w", err)
	}
	err = migrations.Migrate(ctx, tc)
	tc.Close(context.Background())
	if err != nil {
		return fmt.Errorf("migrate template: %w", err)
	}
	if _, err := conn.Exec(ctx, "ALTER DATABASE "+ident(s.template)+" WITH IS_TEMPLATE true ALLOW_CONNECTIONS false"); err != nil {
		return fmt.Errorf("mark template: %w", err)
	}
	return nil
}

func (s *server) close() error {
	if s.cluster != nil {
		return s.cluster.Stop()
	}
	if s.template == "" {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_ = s.adminExec(ctx, "ALTER DATABASE "+ident(s.template)+" WITH IS_TEMPLATE false")
	return s.adminExec(ctx, "DROP DATABASE IF EXISTS "+ident(s.template)+" WITH (FORCE)")
}

func (s *server) adminExec(ctx context.Context, sql string, args ...any) error {
	conn, err := pgx.Connect(ctx, s.adminDSN)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, sql, args...)
	return err
}

// database is a fresh database for one scenario run.
type database struct {
	Name string
	OID  uint32
	// DSN is the unix-socket DSN (for DATABASE_URL: as given), TCP the
	// TCP one ("" if unknown).
	DSN, TCP string
	s        *server
}

// newDatabase creates a database for one scenario run: a clone of the
// migrated template, or (bellhop false) an empty one.
func (s *server) newDatabase(ctx context.Context, prefix string, bellhop bool) (*database, error) {
	name := "bench_" + prefix + "_" + randomHex(4)
	sql := "CREATE DATABASE " + ident(name)
	if bellhop {
		sql += " TEMPLATE " + ident(s.template)
	}
	if err := s.adminExec(ctx, sql); err != nil {
		return nil, fmt.Errorf("create database: %w", err)
	}
	db := &database{Name: name, s: s}
	var err error
	if db.DSN, err = pgdsn.WithDatabase(s.adminDSN, name); err != nil {
		return nil, err
	}
	if s.adminTCP != "" {
		if db.TCP, err = pgdsn.WithDatabase(s.adminTCP, name); err != nil {
			return nil, err
		}
	}
	conn, err := pgx.Connect(ctx, s.adminDSN)
	if err != nil {
		return nil, err
	}
	defer conn.Close(context.Background())
	if err := conn.QueryRow(ctx, "SELECT oid FROM pg_database WHERE datname = $1", name).Scan(&db.OID); err != nil {
		return nil, fmt.Errorf("database oid: %w", err)
	}
	return db, nil
}

// drop removes the database, disconnecting whoever is left.
func (db *database) drop() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_ = db.s.adminExec(ctx, "DROP DATABASE IF EXISTS "+ident(db.Name)+" WITH (FORCE)")
}

// stmtStat is one row of pg_stat_statements.
type stmtStat struct {
	Query     string  `json:"query"`
	Calls     int64   `json:"calls"`
	TotalMS   float64 `json:"total_ms"`
	MeanMS    float64 `json:"mean_ms"`
	Rows      int64   `json:"rows"`
	SharedHit int64   `json:"shared_blks_hit"`
}

// resetStatements clears pg_stat_statements for db only.
func (db *database) resetStatements(ctx context.Context) error {
	if !db.s.pss {
		return errors.New("pg_stat_statements is not available")
	}
	return db.s.adminExec(ctx, "SELECT pg_stat_statements_reset(0, $1::oid, 0)", db.OID)
}

// stmtDeallocs returns pg_stat_statements_info.dealloc: how many times
// the server has evicted entries to make room, since the last full reset.
func (s *server) stmtDeallocs(ctx context.Context) (int64, error) {
	conn, err := pgx.Connect(ctx, s.adminDSN)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.Background())
	var n int64
	err = conn.QueryRow(ctx, "SELECT dealloc FROM pg_stat_statements_info").Scan(&n)
	return n, err
}

// stmtWindow gathers pg_stat_statements evidence of db over a stretch
// of a scenario run: open resets the statistics, close files what was
// counted since under label.
type stmtWindow struct {
	e               *env
	db              *database
	scenario, label string
	top             int
	opened          bool
}

// open resets db's statement statistics. When the reset fails (its user
// may not EXECUTE pg_stat_statements_reset) what close would read counts
// the run's set-up statements too: it is noted under the scenario, and
// close files nothing.
func (w *stmtWindow) open(ctx context.Context) {
	if err := w.db.resetStatements(ctx); err != nil {
		w.e.res.Note(w.scenario, "%s: no statement evidence: pg_stat_statements_reset failed (%v), so the statements counted would include the set-up's", w.label, pgdsn.RedactError(err, w.db.s.adminDSN))
		w.opened = false
		return
	}
	w.opened = true
}

// close files db's statements since open as evidence, if open's reset
// succeeded.
func (w *stmtWindow) close(ctx context.Context) {
	if !w.opened {
		return
	}
	st, err := w.db.statements(ctx)
	if err != nil {
		w.e.res.Note(w.scenario, "%s: no statement evidence: reading pg_stat_statements failed (%v)", w.label, pgdsn.RedactError(err, w.db.s.adminDSN))
		return
	}
	w.e.evidence.addStatements(w.label, st, w.top)
}

// statements returns db's statements since the last reset, by total time.
func (db *database) statements(ctx context.Context) ([]stmtStat, error) {
	if !db.s.pss {
		return nil, errors.New("pg_stat_statements is not available")
	}
	conn, err := pgx.Connect(ctx, db.s.adminDSN)
	if err != nil {
		return nil, err
	}
	defer conn.Close(context.Background())
	rows, err := conn.Query(ctx, `SELECT query, calls, total_exec_time, mean_exec_time, rows, shared_blks_hit
		FROM pg_stat_statements WHERE dbid = $1 ORDER BY total_exec_time DESC`, db.OID)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (stmtStat, error) {
		var st stmtStat
		err := r.Scan(&st.Query, &st.Calls, &st.TotalMS, &st.MeanMS, &st.Rows, &st.SharedHit)
		return st, err
	})
}

// transactions returns xact_commit + xact_rollback of db from
// pg_stat_database, reading a fresh stats snapshot.
func (db *database) transactions(ctx context.Context) (int64, error) {
	conn, err := pgx.Connect(ctx, db.s.adminDSN)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.Background())
	var n int64
	err = conn.QueryRow(ctx, "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datid = $1", db.OID).Scan(&n)
	return n, err
}

// autovacuums returns how many autovacuum and autoanalyze runs db's
// tables have had. It connects to db itself, which is one transaction.
func (db *database) autovacuums(ctx context.Context) (int64, error) {
	conn, err := pgx.Connect(ctx, db.DSN)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.Background())
	var n int64
	err = conn.QueryRow(ctx, "SELECT coalesce(sum(autovacuum_count + autoanalyze_count), 0) FROM pg_stat_all_tables").Scan(&n)
	return n, err
}

// transport names how a DSN reaches the server.
func transport(dsn string) string {
	tcp, err := isTCP(dsn)
	switch {
	case err != nil:
		return "unknown"
	case tcp:
		return "TCP"
	}
	return "unix socket"
}

func isTCP(dsn string) (bool, error) {
	cfg, err := pgconn.ParseConfig(dsn)
	if err != nil {
		return false, err
	}
	return !strings.HasPrefix(cfg.Host, "/"), nil
}

func ident(name string) string { return pgx.Identifier{name}.Sanitize() }

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
