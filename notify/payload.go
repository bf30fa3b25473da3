package notify

import (
	"errors"
	"fmt"
	"strings"

	"github.com/google/uuid"

	"github.com/bellhopq/bellhop/internal/validate"
)

// Channel is the one channel every Bellhop notification goes to but the
// leases (ParseLease), which go to a dispatcher's own channel. Senders:
//   - q: the notify trigger on queue_messages, bellhop_notify_queue_message
//     (its function last replaced in migrations/0045_lease_key.sql, its
//     trigger last re-created in 0052_busy_keys_64.sql), and the
//     dispatcher's sql/reclaim.sql, sql/release.sql and sql/hand_over.sql;
//   - o: the outbox's trigger (migrations/0036_notify.sql), and the same
//     three statements of the dispatcher;
//   - c: the triggers on triggers and queue_trigger_details
//     (migrations/0039_helpers.sql, the latter re-created in
//     0040_push_consumers.sql);
//   - h: the dispatcher's sql/poll.sql and sql/wake_scan.sql;
//   - b: the dispatcher's sql/busy_mark.sql and sql/busy_hold.sql.
const Channel = "bellhop"

// Kind says what a notification announces.
type Kind byte

// The kinds of notification, by their payload prefix.
const (
	KindQueue     Kind = 'q' // q:<app_id>:<queue_name>
	KindInvoke    Kind = 'o' // o:<app_id>:<trigger_id>
	KindConsumers Kind = 'c' // c
	KindHeartbeat Kind = 'h' // h:<token>
	KindBusy      Kind = 'b' // b:<app_id>:<owner>:<queue_name>: a dispatcher marked the queue busy
)

// Event is a parsed notification.
type Event struct {
	Kind      Kind
	AppID     uuid.UUID // KindQueue, KindInvoke
	Queue     string    // KindQueue
	TriggerID uuid.UUID // KindInvoke
	Token     string    // KindHeartbeat
	Owner     uuid.UUID // KindBusy: the dispatcher that holds the mark
}

// ErrGarbled is wrapped by every Parse error.
var ErrGarbled = errors.New("garbled notification")

// maxTokenLen bounds heartbeat tokens; Bellhop's own are 32 hex digits.
const maxTokenLen = 64

// Parse reads a payload sent on Channel. Anyone who can connect to the
// database can NOTIFY on the channel, so Parse accepts only the exact
// forms above and rejects everything else with ErrGarbled.
func Parse(payload string) (Event, error) {
	kind, rest, _ := strings.Cut(payload, ":")
	switch {
	case kind == "c" && payload == "c":
		return Event{Kind: KindConsumers}, nil
	case kind == "h":
		if rest == "" || len(rest) > maxTokenLen || strings.IndexFunc(rest, notAlnum) >= 0 {
			return Event{}, garbled(payload, "bad heartbeat token")
		}
		return Event{Kind: KindHeartbeat, Token: rest}, nil
	case kind == "b":
		appText, rest, ok1 := strings.Cut(rest, ":")
		ownerText, name, ok2 := strings.Cut(rest, ":")
		if !ok1 || !ok2 {
			return Event{}, garbled(payload, "missing field")
		}
		appID, err1 := parseUUID(appText)
		owner, err2 := parseUUID(ownerText)
		if err1 != nil || err2 != nil || validate.QueueName(name) != nil {
			return Event{}, garbled(payload, "bad busy mark")
		}
		return Event{Kind: KindBusy, AppID: appID, Owner: owner, Queue: name}, nil
	case kind == "q" || kind == "o":
		idText, name, ok := strings.Cut(rest, ":")
		if !ok {
			return Event{}, garbled(payload, "missing field")
		}
		appID, err := parseUUID(idText)
		if err != nil {
			return Event{}, garbled(payload, "bad app id")
		}
		if kind == "q" {
			if validate.QueueName(name) != nil {
				return Event{}, garbled(payload, "bad queue name")
			}
			return Event{Kind: KindQueue, AppID: appID, Queue: name}, nil
		}
		triggerID, err := parseUUID(name)
		if err != nil {
			return Event{}, garbled(payload, "bad consumer id")
		}
		return Event{Kind: KindInvoke, AppID: appID, TriggerID: triggerID}, nil
	}
	return Event{}, garbled(payload, "unknown kind")
}

func notAlnum(r rune) bool {
	return !(r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z')
}

// parseUUID accepts only the canonical form PostgreSQL prints: 36
// characters, lower-case hex.
func parseUUID(s string) (uuid.UUID, error) {
	u, err := uuid.Parse(s)
	if err != nil || u.String() != s {
		return uuid.UUID{}, errors.New("not a canonical uuid")
	}
	return u, nil
}

// garbled returns the error for a rejected payload. Its text is built
// only if someone asks for it: a flood of garbage on the channel is
// counted, and logged once a minute, so formatting every rejection would
// only slow the listener down, and with it the real notifications queued
// behind the garbage.
func garbled(payload, why string) error {
	return &garbledError{payload: payload, why: why}
}

type garbledError struct{ payload, why string }

func (e *garbledError) Error() string {
	payload := e.payload
	if len(payload) > 80 {
		payload = payload[:80] + "…"
	}
	return fmt.Sprintf("%v (%s): %q", ErrGarbled, e.why, payload)
}

func (e *garbledError) Unwrap() error { return ErrGarbled }

// String prints the payload form of e; Parse(e.String()) returns e.
func (e Event) String() string {
	switch e.Kind {
	case KindQueue:
		return "q:" + e.AppID.String() + ":" + e.Queue
	case KindInvoke:
		return "o:" + e.AppID.String() + ":" + e.TriggerID.String()
	case KindConsumers:
		return "c"
	case KindHeartbeat:
		return "h:" + e.Token
	case KindBusy:
		return "b:" + e.AppID.String() + ":" + e.Owner.String() + ":" + e.Queue
	}
	return ""
}
