package notify

import (
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// FuzzParse feeds Parse arbitrary payloads, as anyone who can connect may
// NOTIFY on the channel: it must never panic, must accept only the
// documented forms, and what it accepts must print back to the same
// payload.
func FuzzParse(f *testing.F) {
	for _, s := range []string{
		"c",
		"h:0123456789abcdef0123456789abcdef",
		"q:9b2f4a4e-3c1d-4e55-8a77-0c5d4f1b2a3c:orders",
		"q:9b2f4a4e-3c1d-4e55-8a77-0c5d4f1b2a3c:a.b-c_d:e",
		"o:9b2f4a4e-3c1d-4e55-8a77-0c5d4f1b2a3c:1c6a2b3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d",
		"b:9b2f4a4e-3c1d-4e55-8a77-0c5d4f1b2a3c:1c6a2b3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d:orders",
		"b:9b2f4a4e-3c1d-4e55-8a77-0c5d4f1b2a3c:orders", "b:::",
		"", ":", "q", "q:", "q::", "q:not-a-uuid:orders", "x:y:z", "c:extra", "h:", "h:a:b",
		"q:9b2f4a4e-3c1d-4e55-8a77-0c5d4f1b2a3c:" + strings.Repeat("a", 129),
		"q:9b2f4a4e-3c1d-4e55-8a77-0c5d4f1b2a3c:'; DROP TABLE queue_messages; --",
		"q:{9b2f4a4e-3c1d-4e55-8a77-0c5d4f1b2a3c}:orders",
		"q:9b2f4a4e3c1d4e558a770c5d4f1b2a3c:orders",
		"\x00", "q:\x00:\x00", "h:\xff\xfe",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, payload string) {
		ev, err := Parse(payload)
		if err != nil {
			if ev != (Event{}) {
				t.Fatalf("Parse(%q) returned %+v with error %v", payload, ev, err)
			}
			return
		}
		if got := ev.String(); got != payload {
			t.Fatalf("Parse(%q).String() = %q", payload, got)
		}
		if !utf8.ValidString(payload) {
			t.Fatalf("accepted invalid UTF-8 %q", payload)
		}
		switch ev.Kind {
		case KindQueue, KindInvoke, KindConsumers, KindHeartbeat, KindBusy:
		default:
			t.Fatalf("accepted unknown kind %q", ev.Kind)
		}
	})
}

// FuzzParseLease does for lease notifications what FuzzParse does for the
// shared channel: whoever learns a dispatcher's lease channel may send it
// anything.
func FuzzParseLease(f *testing.F) {
	for _, s := range []string{
		"l:9b2f4a4e-3c1d-4e55-8a77-0c5d4f1b2a3c:1c6a2b3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d:1:3:1764547200000000:1764547200001000::30:{}",
		"l:9b2f4a4e-3c1d-4e55-8a77-0c5d4f1b2a3c:1c6a2b3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d:2:5:-5:7:9b2f4a4e-3c1d-4e55-8a77-0c5d4f1b2a3c::{\"a\":\"b:c\"}",
		"l:9b2f4a4e-3c1d-4e55-8a77-0c5d4f1b2a3c:1c6a2b3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d:01:3:1:1::30:{}",
		"l:9b2f4a4e-3c1d-4e55-8a77-0c5d4f1b2a3c:1c6a2b3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d:1:3:1:1::030:{}",
		"l:9b2f4a4e-3c1d-4e55-8a77-0c5d4f1b2a3c:1c6a2b3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d:1:3:1:1::43201:{}",
		"l:9b2f4a4e-3c1d-4e55-8a77-0c5d4f1b2a3c:1c6a2b3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d:1:3:1:1::30:",
		"l:::::::::", "l:", "q:9b2f4a4e-3c1d-4e55-8a77-0c5d4f1b2a3c:orders", "",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, payload string) {
		l, err := ParseLease(payload)
		if err != nil {
			if l.Token != [16]byte{} || l.Payload != nil {
				t.Fatalf("ParseLease(%q) returned %+v with error %v", payload, l, err)
			}
			return
		}
		if got := l.String(); got != payload {
			t.Fatalf("ParseLease(%q).String() = %q", payload, got)
		}
		if l.Attempt < 1 || l.MaxAttempts < 1 {
			t.Fatalf("accepted attempt %d of %d", l.Attempt, l.MaxAttempts)
		}
		if l.VisibilityTimeout < time.Second || l.VisibilityTimeout > 12*time.Hour || l.VisibilityTimeout%time.Second != 0 {
			t.Fatalf("accepted visibility timeout %s", l.VisibilityTimeout)
		}
	})
}
