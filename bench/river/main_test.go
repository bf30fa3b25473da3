package main

import (
	"io"
	"strings"
	"testing"
	"time"
)

func TestParseFlagsDefaults(t *testing.T) {
	o, err := parseFlags([]string{"-database-url", "dsn", "-scenario", "latency"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.N != 2000 || o.Interval != 10*time.Millisecond || o.Schema != "river_bench" || o.Workers != 100 {
		t.Fatalf("unexpected defaults: %+v", o)
	}
	if o.effectiveFetchCooldown() != 100*time.Millisecond || o.effectiveFetchPollInterval() != time.Second {
		t.Fatalf("unexpected effective fetch settings: %s %s", o.effectiveFetchCooldown(), o.effectiveFetchPollInterval())
	}

	o, err = parseFlags([]string{"-database-url", "dsn", "-scenario", "burndown"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.N != 20000 {
		t.Fatalf("burndown default n = %d, want 20000", o.N)
	}
}

func TestParseFlagsErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"-scenario", "latency"}, "-database-url is required"},
		{[]string{"-database-url", "x"}, "-scenario is required"},
		{[]string{"-database-url", "x", "-scenario", "soak"}, `-scenario "soak"`},
		{[]string{"-database-url", "x", "-scenario", "latency", "-schema", "Bad-Name"}, "-schema"},
		{[]string{"-database-url", "x", "-scenario", "latency", "-workers", "0"}, "-workers 0"},
		{[]string{"-database-url", "x", "-scenario", "latency", "-n", "-1"}, "-n -1"},
		{[]string{"-database-url", "x", "-scenario", "latency", "-fetch-poll-interval", "20ms"}, "shorter than fetch cooldown"},
		{[]string{"-database-url", "x", "-scenario", "latency", "-fetch-cooldown", "1us"}, "-fetch-cooldown"},
		{[]string{"-database-url", "x", "-scenario", "latency", "extra"}, "unexpected argument"},
		{[]string{"-database-url", "x", "-scenario", "latency", "-interval", "soon"}, "invalid value"},
	} {
		var stderr strings.Builder
		_, err := parseFlags(tc.args, &stderr)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("parseFlags(%q) = %v, want error containing %q", tc.args, err, tc.want)
		}
	}
}

func TestParseFlagsFastFetch(t *testing.T) {
	o, err := parseFlags([]string{"-database-url", "x", "-scenario", "latency",
		"-fetch-cooldown", "2ms", "-fetch-poll-interval", "20ms"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.effectiveFetchCooldown() != 2*time.Millisecond || o.effectiveFetchPollInterval() != 20*time.Millisecond {
		t.Fatalf("unexpected fetch settings: %+v", o)
	}
}

func TestPercentile(t *testing.T) {
	s := make([]int64, 100)
	for i := range s {
		s[i] = int64(i + 1)
	}
	for _, tc := range []struct {
		p    float64
		want int64
	}{{0.5, 50}, {0.9, 90}, {0.99, 99}, {1, 100}, {0.001, 1}} {
		if got := percentile(s, tc.p); got != tc.want {
			t.Errorf("percentile(1..100, %v) = %d, want %d", tc.p, got, tc.want)
		}
	}
	if got := percentile([]int64{7}, 0.99); got != 7 {
		t.Errorf("percentile([7], 0.99) = %d, want 7", got)
	}
}

func TestSplitOf(t *testing.T) {
	// Unsorted nanoseconds in, microseconds out.
	ns := []int64{9_000, 1_000, 5_000, 3_000, 7_000, 2_000, 4_000, 6_000, 8_000, 10_000}
	got := splitOf(ns)
	if want := (split{P50US: 5, P99US: 10}); got != want {
		t.Errorf("splitOf = %+v, want %+v", got, want)
	}
}
