package notify

import (
	"errors"
	"testing"
	"time"
)

// TestParseLeaseTimeout: the lease's visibility timeout is whole seconds,
// 1 to 43,200 as a consumer's may be; anything else garbles the
// notification, an empty one too: since migration 0047 a queue without a
// consumer is never leased, and the dispatcher measured a lease without a
// timeout with its loaded copy of the consumer's, which may be a reload
// behind.
func TestParseLeaseTimeout(t *testing.T) {
	const head = "l:9b2f4a4e-3c1d-4e55-8a77-0c5d4f1b2a3c:1c6a2b3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d:1:3:1764547200000000:1764547200001000::"
	for _, c := range []struct {
		vt   string
		want time.Duration // -1: garbled
	}{
		{"30", 30 * time.Second},
		{"", -1},
		{"1", time.Second},
		{"43200", 12 * time.Hour},
		{"43201", -1},
		{"0", -1},
		{"-5", -1},
		{"030", -1},
		{"+30", -1},
		{"3e1", -1},
		{"30 ", -1},
	} {
		l, err := ParseLease(head + c.vt + `:{"a":1}`)
		switch {
		case c.want < 0 && !errors.Is(err, ErrGarbled):
			t.Errorf("timeout %q: accepted (%s), want ErrGarbled", c.vt, l.VisibilityTimeout)
		case c.want >= 0 && err != nil:
			t.Errorf("timeout %q: %v", c.vt, err)
		case c.want >= 0 && l.VisibilityTimeout != c.want:
			t.Errorf("timeout %q: got %s, want %s", c.vt, l.VisibilityTimeout, c.want)
		case c.want >= 0 && string(l.Payload) != `{"a":1}`:
			t.Errorf("timeout %q: payload %q", c.vt, l.Payload)
		}
	}
}
