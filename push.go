package bellhop

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Header names of a push delivery, exported so that consumer-side code
// written in Go can read them without retyping the strings.
const (
	// HeaderMessageID is the message id, the same on every attempt: the
	// key a consumer dedupes on, since delivery is at least once. Like the
	// other headers but the timestamp, it is not signed: a captured
	// request replayed within the window may carry another id. Where that
	// matters, dedupe on a key inside the payload, which is signed.
	HeaderMessageID = "Bellhop-Message-Id"
	// HeaderApp is the app's name.
	HeaderApp = "Bellhop-App"
	// HeaderQueue is the queue's name.
	HeaderQueue = "Bellhop-Queue"
	// HeaderAttempt is the delivery attempt, 1 on the first.
	HeaderAttempt = "Bellhop-Attempt"
	// HeaderMaxAttempts is the attempt after which a failure dead-letters
	// the message, so a consumer can tell its last chance.
	HeaderMaxAttempts = "Bellhop-Max-Attempts"
	// HeaderEnqueuedAt is when the message was enqueued, RFC 3339 in UTC
	// with the fraction's trailing zeros dropped (time.RFC3339Nano): up to
	// six digits, since PostgreSQL keeps microseconds, and none for a
	// whole second.
	HeaderEnqueuedAt = "Bellhop-Enqueued-At"
	// HeaderConsumerID is the consumer's id, for consumers that serve
	// several registrations from one endpoint.
	HeaderConsumerID = "Bellhop-Consumer-Id"
	// HeaderSource is "queue" for queue messages and "invoke" for
	// invoke_async deliveries.
	HeaderSource = "Bellhop-Source"
	// HeaderTimestamp is when the request was signed, in unix seconds; it
	// is covered by the signature.
	HeaderTimestamp = "Bellhop-Timestamp"
	// HeaderSignature carries "v1=<hex>" signatures (see SignPush).
	HeaderSignature = "Bellhop-Signature"
)

// DefaultPushWindow is the replay window VerifyPush applies when it is given none:
// wide enough for ordinary clock skew and queueing inside the consumer,
// narrow enough that a captured request cannot be replayed much later.
const DefaultPushWindow = 5 * time.Minute

// pushSignatureScheme prefixes each signature so that a future scheme (v2=)
// can be sent alongside v1 during a migration without breaking verifiers.
const pushSignatureScheme = "v1="

// Errors returned by VerifyPush; each error it returns wraps exactly one, so
// that a consumer can answer with a precise status or log line.
var (
	// ErrNoSignature: the request carries no Bellhop-Timestamp or no v1
	// signature; it did not come from Bellhop, or a proxy stripped them.
	ErrNoSignature = errors.New("bellhop: request is not signed")
	// ErrBadSignature: the headers are garbled, or no signature matches
	// the body and timestamp under the secret (tampering or wrong secret).
	ErrBadSignature = errors.New("bellhop: bad signature")
	// ErrStaleSignature: the signature is valid but its timestamp is outside the
	// window around now, so the request may be a replay.
	ErrStaleSignature = errors.New("bellhop: signature timestamp outside the allowed window")
)

// SignPush returns the Bellhop-Signature value for body sent at timestamp (unix
// seconds): "v1=" and the hex HMAC-SHA256, keyed with secret's bytes, of
// "<timestamp>.<body>". The timestamp is inside the MAC so that a captured
// request cannot be replayed later with a fresh Bellhop-Timestamp.
func SignPush(secret string, timestamp int64, body []byte) string {
	return pushSignatureScheme + hex.EncodeToString(pushMAC(secret, timestamp, body))
}

func pushMAC(secret string, timestamp int64, body []byte) []byte {
	h := hmac.New(sha256.New, []byte(secret))
	h.Write(strconv.AppendInt(nil, timestamp, 10))
	h.Write([]byte{'.'})
	h.Write(body)
	return h.Sum(nil)
}

// VerifyPush is the consumer-side check of a push delivery: it returns nil if
// header carries a v1 signature of body, under secret, whose timestamp is
// within window of now (DefaultPushWindow if window <= 0; the check cannot be
// switched off, since without it a captured request replays forever).
//
// Bellhop-Signature may hold several comma-separated values, and may be
// repeated; any matching v1 value is enough, so that a receiver that holds
// either the old or the new secret accepts a request while a secret is
// rotated (Client.RotateConsumerSecret: bellhop run signs with both for a
// while). Values of other schemes are ignored.
// Comparison is constant-time.
//
// body must be the raw request body, byte for byte: re-encoded JSON will
// not verify. The signature is checked before the timestamp, so ErrStaleSignature
// is only returned for requests that genuinely came from the secret's
// holder.
func VerifyPush(secret string, header http.Header, body []byte, now time.Time, window time.Duration) error {
	if window <= 0 {
		window = DefaultPushWindow
	}
	if secret == "" {
		// An empty key would let anyone compute a matching signature.
		return fmt.Errorf("%w: no secret to verify with", ErrBadSignature)
	}
	tsValues := header.Values(HeaderTimestamp)
	var sigs []string
	for _, v := range header.Values(HeaderSignature) {
		for s := range strings.SplitSeq(v, ",") {
			if s = strings.TrimSpace(s); s != "" {
				sigs = append(sigs, s)
			}
		}
	}
	if len(tsValues) == 0 || len(sigs) == 0 {
		return fmt.Errorf("%w: missing %s or %s header", ErrNoSignature, HeaderTimestamp, HeaderSignature)
	}
	if len(tsValues) > 1 {
		return fmt.Errorf("%w: %d %s headers", ErrBadSignature, len(tsValues), HeaderTimestamp)
	}
	ts, err := strconv.ParseInt(tsValues[0], 10, 64)
	// Only the canonical form is accepted ("+5" or "05" would verify
	// differently from how SignPush formats the number).
	if err != nil || strconv.FormatInt(ts, 10) != tsValues[0] {
		return fmt.Errorf("%w: %s is not unix seconds", ErrBadSignature, HeaderTimestamp)
	}
	want := pushMAC(secret, ts, body)
	sawV1 := false
	for _, s := range sigs {
		hexSig, ok := strings.CutPrefix(s, pushSignatureScheme)
		if !ok {
			continue
		}
		sawV1 = true
		got, err := hex.DecodeString(hexSig)
		if err != nil {
			continue // garbled value; another may still match
		}
		if hmac.Equal(got, want) {
			if skew := time.Unix(ts, 0).Sub(now); skew > window || skew < -window {
				return fmt.Errorf("%w: timestamp is %s from now, allowed ±%s", ErrStaleSignature, skew.Round(time.Second), window)
			}
			return nil
		}
	}
	if !sawV1 {
		return fmt.Errorf("%w: no %s value in %s", ErrNoSignature, strings.TrimSuffix(pushSignatureScheme, "="), HeaderSignature)
	}
	return fmt.Errorf("%w: no signature matches the body and timestamp", ErrBadSignature)
}
