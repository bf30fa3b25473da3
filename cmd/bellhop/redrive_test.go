package main

import (
	"strings"
	"testing"

	"github.com/bellhopq/bellhop/internal/pgtest"
)

// TestRedriveSaysWhatStayed: a redrive that could move some dead letters
// and not others moves those it can, prints how many, and exits 2 naming
// why the rest stayed. A dead letter whose id a producer had reused for a
// live message made the whole redrive fail with a bare unique violation
// (exit 1), moving nothing.
func TestRedriveSaysWhatStayed(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	ok(t, dsn, "app", "create", "shop")
	pool := db(t, dsn)
	seedDeadLetters(t, pool, 2)
	if _, err := pool.Exec(t.Context(), `INSERT INTO queue_messages (id, app_id, queue_name, payload)
		SELECT id, app_id, 'orders', '{"second":"life"}' FROM dead_letters ORDER BY id LIMIT 1`); err != nil {
		t.Fatal(err)
	}
	r := exe(t, dsn, "", "dead", "redrive", "--app", "shop", "--queue", "orders")
	if r.code != 2 || strings.TrimSpace(r.stdout) != "redrove 1 dead letters" ||
		!strings.Contains(r.stderr, "1 dead letter(s) not redriven") || !strings.Contains(r.stderr, "id a live message has taken again") {
		t.Errorf("want exit 2, 1 redriven and the reason the other stayed; got %s", r)
	}
	if n := queryInt(t, pool, "SELECT count(*) FROM dead_letters"); n != 1 {
		t.Errorf("%d dead letters left, want 1", n)
	}
	if n := queryInt(t, pool, "SELECT count(*) FROM queue_messages"); n != 2 {
		t.Errorf("%d messages queued, want 2 (the live one and the redriven one)", n)
	}
}
