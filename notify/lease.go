package notify

import (
	"encoding/json"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
)

// Lease is a parsed lease notification: a producer leased a new message
// under one of the dispatcher's offer tokens (migrations/0044_lease_at_insert.sql)
// and sent it, payload included, on the dispatcher's own channel:
//
//	l:<token>:<id>:<attempt>:<max_attempts>:<enqueued_at µs>:<claimed_at µs>:<principal>:<vt secs>:<payload>
//
// The principal is empty when the message has none; the visibility
// timeout is the consumer's as the producer's transaction read it
// (migrations/0047_vt_floor.sql), whole seconds from 1 to 43,200. It is
// never empty: since 0047 a queue without a consumer is not leased, so a
// lease without one can only be forged, and ParseLease rejects it.
type Lease struct {
	Token       uuid.UUID
	ID          uuid.UUID
	Attempt     int
	MaxAttempts int
	EnqueuedAt  time.Time
	// ClaimedAt is the database's clock when the producer leased the
	// message: the start of the lease by the reclaimer's reckoning.
	ClaimedAt  time.Time
	EnqueuedBy *uuid.UUID
	// VisibilityTimeout is the one the lease is measured with: the
	// consumer's as the producer's transaction read it, never zero.
	VisibilityTimeout time.Duration
	Payload           []byte
}

// ParseLease reads a payload sent on a dispatcher's lease channel. The
// channel's name is a secret, but the dispatcher trusts a lease only for a
// token it issued and has not seen used; ParseLease checks the form, and
// rejects everything else with ErrGarbled.
func ParseLease(payload string) (Lease, error) {
	kind, rest, _ := strings.Cut(payload, ":")
	if kind != "l" {
		return Lease{}, garbled(payload, "unknown kind")
	}
	// Eight fields, then the payload, which may hold colons of its own.
	var f [8]string
	for i := range f {
		var ok bool
		f[i], rest, ok = strings.Cut(rest, ":")
		if !ok {
			return Lease{}, garbled(payload, "missing field")
		}
	}
	var l Lease
	var err error
	if l.Token, err = parseUUID(f[0]); err != nil {
		return Lease{}, garbled(payload, "bad token")
	}
	if l.ID, err = parseUUID(f[1]); err != nil {
		return Lease{}, garbled(payload, "bad message id")
	}
	if l.Attempt, err = strconv.Atoi(f[2]); err != nil || l.Attempt < 1 || strconv.Itoa(l.Attempt) != f[2] {
		return Lease{}, garbled(payload, "bad attempt")
	}
	if l.MaxAttempts, err = strconv.Atoi(f[3]); err != nil || l.MaxAttempts < 1 || strconv.Itoa(l.MaxAttempts) != f[3] {
		return Lease{}, garbled(payload, "bad max attempts")
	}
	enq, err1 := strconv.ParseInt(f[4], 10, 64)
	claimed, err2 := strconv.ParseInt(f[5], 10, 64)
	if err1 != nil || err2 != nil || strconv.FormatInt(enq, 10) != f[4] || strconv.FormatInt(claimed, 10) != f[5] {
		return Lease{}, garbled(payload, "bad timestamp")
	}
	l.EnqueuedAt, l.ClaimedAt = time.UnixMicro(enq), time.UnixMicro(claimed)
	if f[6] != "" {
		p, err := parseUUID(f[6])
		if err != nil {
			return Lease{}, garbled(payload, "bad principal")
		}
		l.EnqueuedBy = &p
	}
	vt, err := strconv.Atoi(f[7])
	if err != nil || vt < 1 || vt > maxVTSecs || strconv.Itoa(vt) != f[7] {
		return Lease{}, garbled(payload, "bad visibility timeout")
	}
	l.VisibilityTimeout = time.Duration(vt) * time.Second
	if !json.Valid([]byte(rest)) {
		return Lease{}, garbled(payload, "payload is not JSON")
	}
	l.Payload = []byte(rest)
	return l, nil
}

// String prints the payload form of l; ParseLease(l.String()) returns l
// for every l that ParseLease returns.
func (l Lease) String() string {
	by := ""
	if l.EnqueuedBy != nil {
		by = l.EnqueuedBy.String()
	}
	vt := strconv.Itoa(int(l.VisibilityTimeout / time.Second))
	return "l:" + l.Token.String() + ":" + l.ID.String() + ":" + strconv.Itoa(l.Attempt) + ":" +
		strconv.Itoa(l.MaxAttempts) + ":" + strconv.FormatInt(l.EnqueuedAt.UnixMicro(), 10) + ":" +
		strconv.FormatInt(l.ClaimedAt.UnixMicro(), 10) + ":" + by + ":" + vt + ":" + string(l.Payload)
}

// maxVTSecs is the longest visibility timeout a consumer may have
// (migrations/0038_constraints.sql).
const maxVTSecs = 43200
