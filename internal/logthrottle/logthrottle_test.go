package logthrottle

import (
	"testing"
	"time"
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
