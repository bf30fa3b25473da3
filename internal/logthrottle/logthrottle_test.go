package logthrottle

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"golang.org/x/time/rate"
)

func TestThrottle(t *testing.T) {
	t.Parallel()
	// An hour between lines: after the burst, nothing more in the test.
	th := New(3, time.Hour)
	var allowed []int
	for range 10 {
		if ok, held := th.Allow(); ok {
			allowed = append(allowed, held)
		}
	}
	if len(allowed) != 3 || allowed[0]+allowed[1]+allowed[2] != 0 {
		t.Fatalf("lines let through with their held-back counts: %v, want the burst of 3, none held back", allowed)
	}

	// One line every 20ms: the next one says how many were held back.
	th = New(1, 20*time.Millisecond)
	if ok, _ := th.Allow(); !ok {
		t.Fatal("the first line was held back")
	}
	held := 0
	for ok := false; !ok; {
		held++
		var n int
		if ok, n = th.Allow(); ok && n != held-1 {
			t.Fatalf("the next line says %d were held back, want %d", n, held-1)
		}
	}
}

func TestEvent(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	log := zerolog.New(&buf).Level(zerolog.DebugLevel)
	warnOnly := zerolog.New(io.Discard).Level(zerolog.WarnLevel)
	th := New(1, time.Hour)

	// Lines the logger leaves out take no share of the throttle.
	for range 3 {
		th.Event(&warnOnly, zerolog.InfoLevel, 1).Msg("left out")
	}
	th.Event(&log, zerolog.WarnLevel, 1).Msg("first")
	// Held back: written at debug level, their things counted by weight.
	th.Event(&log, zerolog.WarnLevel, 5).Msg("second")
	th.Event(&log, zerolog.WarnLevel, 2).Msg("third")

	var lines []map[string]any
	for _, raw := range bytes.Split(bytes.TrimSpace(buf.Bytes()), []byte("\n")) {
		var l map[string]any
		if err := json.Unmarshal(raw, &l); err != nil {
			t.Fatalf("line %q: %v", raw, err)
		}
		lines = append(lines, l)
	}
	want := []string{"first warn", "second debug", "third debug"}
	if len(lines) != len(want) {
		t.Fatalf("wrote %d lines, want %d: %s", len(lines), len(want), buf.String())
	}
	for i, l := range lines {
		if got := fmt.Sprint(l["message"], " ", l["level"]); got != want[i] {
			t.Errorf("line %d is %q, want %q", i, got, want[i])
		}
		if _, ok := l["held_back"]; ok {
			t.Errorf("line %d says held_back: %v", i, l)
		}
	}

	// The next line let through counts the things, not the lines, held back.
	th.limiter.SetLimit(rate.Inf)
	buf.Reset()
	th.Event(&log, zerolog.WarnLevel, 1).Msg("fourth")
	var l map[string]any
	if err := json.Unmarshal(buf.Bytes(), &l); err != nil {
		t.Fatalf("line %q: %v", buf.Bytes(), err)
	}
	if l["level"] != "warn" || l["held_back"] != float64(7) {
		t.Errorf("the line after the held ones is %v, want level warn and held_back 7", l)
	}
}
