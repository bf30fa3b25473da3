package main

import (
	"strings"
	"testing"
)

// TestHostileInputEveryCommand pushes hostile app names, queue names,
// principals and payloads through every command that takes them. Each must
// be refused with one line (or, for a payload that is valid JSON, stored
// as data), and the database must be exactly as before: nothing is ever
// spliced into SQL text.
func TestHostileInputEveryCommand(t *testing.T) {
	dsn, _, consumerID := setup(t)
	pool := db(t, dsn)
	snapshot := func() string {
		var s string
		// Row contents, not counts: an update or pause that wrongly took
		// effect changes no count.
		err := pool.QueryRow(t.Context(), `
			SELECT (SELECT md5(coalesce(string_agg(x::text, ',' ORDER BY x.id), '')) FROM apps x) || '/' ||
			       (SELECT md5(coalesce(string_agg(x::text, ',' ORDER BY x.id), '')) FROM principals x) || '/' ||
			       (SELECT md5(coalesce(string_agg(x::text, ',' ORDER BY x.id), '')) FROM triggers x) || '/' ||
			       (SELECT md5(coalesce(string_agg(x::text, ',' ORDER BY x.trigger_id), '')) FROM queue_trigger_details x) || '/' ||
			       (SELECT md5(coalesce(string_agg(x::text, ',' ORDER BY x.id), '')) FROM queue_messages x) || '/' ||
			       (SELECT md5(coalesce(string_agg(x::text, ',' ORDER BY x.id), '')) FROM dead_letters x) || '/' ||
			       (SELECT count(*) FROM pg_tables WHERE schemaname = 'public')`).Scan(&s)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	before := snapshot()

	hostile := []string{
		`x'; DROP TABLE queue_messages; --`,
		`"; DELETE FROM apps; --`,
		`a\x00b`,
		"naïve",
		strings.Repeat("a", 200),
		`$1`,
		`%s%n`,
		"",
		" ",
		"../../etc/passwd",
	}
	for _, h := range hostile {
		cmds := [][]string{
			{"app", "create", h},
			{"consumer", "add", "--app", h, "--queue", "q", "--url", "http://127.0.0.1:1/"},
			{"consumer", "add", "--app", "shop", "--queue", h, "--url", "http://127.0.0.1:1/"},
			{"consumer", "add", "--app", "shop", "--queue", "q2", "--url", "http://127.0.0.1:1/", "--principal", h},
			{"consumer", "ls", "--app", h},
			{"principal", "ls", "--app", h},
			{"consumer", "update", "--app", h, consumerID, "--max-attempts", "3"},
			{"consumer", "pause", "--app", h, consumerID},
			{"consumer", "rm", "--app", h, consumerID},
			{"consumer", "rm", "--app", "shop", h},
			{"enqueue", "--app", h, "--queue", "orders", `{"a":1}`},
			{"enqueue", "--app", "shop", "--queue", h, `{"a":1}`},
			{"enqueue", "--app", "shop", "--queue", "orders", h},
			{"queues", "--app", h},
			{"dead", "ls", "--app", h},
			{"dead", "ls", "--app", "shop", "--queue", h},
			{"dead", "show", "--app", h, "00000000-0000-0000-0000-000000000000"},
			{"dead", "show", "--app", "shop", h},
			{"dead", "redrive", "--app", h, "--queue", "orders"},
			{"dead", "redrive", "--app", "shop", "--queue", h},
			{"dead", "purge", "--app", h, "--queue", "orders"},
			{"dead", "purge", "--app", "shop", "--queue", h},
		}
		for _, args := range cmds {
			if h == "" && args[len(args)-2] == "--principal" {
				continue // an empty --principal means the app's default
			}
			r := exe(t, dsn, "", args...)
			name := strings.Join(args, " ")
			if strings.Contains(r.stderr, "goroutine ") || strings.Contains(r.stderr, "panic") {
				t.Errorf("bellhop %q crashed:\n%s", name, r)
			}
			if r.code != 0 && strings.Count(strings.TrimSpace(r.stderr), "\n") > 0 {
				t.Errorf("bellhop %q: want a one-line error:\n%s", name, r)
			}
			// No hostile value is an app's or a valid queue name: a listing
			// refuses it as every other command does. Empty, it means
			// every app for consumer ls and queues, and every queue for
			// dead ls, whose --app must not be empty. Nothing may ever be
			// written.
			if args[0] == "queues" || args[1] == "ls" {
				want := 2
				if h == "" && !(args[0] == "dead" && args[3] == "") {
					want = 0
				}
				if r.code != want {
					t.Errorf("bellhop %q: exit %d, want %d:\n%s", name, r.code, want, r)
				}
			} else if r.code != 2 {
				// Every other command is refused as bad input.
				t.Errorf("bellhop %q: exit %d, want 2:\n%s", name, r.code, r)
			}
			if after := snapshot(); after != before {
				t.Fatalf("bellhop %q changed the database: %s -> %s\n%s", name, before, after, r)
			}
		}
	}
}
