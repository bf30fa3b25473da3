// Package validate checks producer and operator input before it reaches
// the database, which gives callers a typed error that names the problem.
// The database enforces most of the same rules with constraints, for
// writers that do not come through here (see migrations/0038_constraints.sql),
// but not all: it does not limit a payload's nesting, and it measures a
// payload's size as jsonb text rather than as given. Numbers are checked
// against numeric's range here too, and a payload whose numbers alone
// would pass the size limit as jsonb text is refused here, before the
// server writes them out in full (1e131071 as 131,072 digits).
package validate

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/bellhopq/bellhop/internal/pgdsn"
	"github.com/bellhopq/bellhop/internal/printable"
)

// Limits shared with the schema's constraints.
const (
	MaxQueueNameBytes = 128
	MaxPayloadBytes   = 1 << 20
	MaxPayloadDepth   = 128
	MaxAttempts       = 1000
	MaxDelay          = 10 * 365 * 24 * time.Hour
	MinVisibility     = time.Second
	MaxVisibility     = 12 * time.Hour
	MaxInFlight       = 10000
	MaxBackoff        = 24 * time.Hour
)

// Sentinel errors; every error this package returns wraps exactly one.
var (
	ErrQueueName  = errors.New("invalid queue name")
	ErrName       = errors.New("invalid name")
	ErrPayload    = errors.New("invalid payload")
	ErrTooLarge   = errors.New("payload too large")
	ErrOption     = errors.New("invalid option")
	ErrNotAllowed = errors.New("not allowed")
)

var (
	queueNameRE = regexp.MustCompile(`^[A-Za-z0-9._:-]{1,128}$`)
	nameRE      = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`)
)

// QueueName checks that s is 1 to 128 bytes of [A-Za-z0-9._:-].
func QueueName(s string) error {
	if !queueNameRE.MatchString(s) {
		return fmt.Errorf("%w %s: a queue name is 1 to %d bytes of [A-Za-z0-9._:-]", ErrQueueName, Shown(s), MaxQueueNameBytes)
	}
	return nil
}

// NameRule states the rule Name checks, as its errors give it.
const NameRule = "use 1 to 63 bytes of [A-Za-z0-9._-], starting with a letter or digit"

// Name checks an app or principal name: 1 to 63 bytes of [A-Za-z0-9._-],
// starting with a letter or digit.
func Name(kind, s string) error {
	if !nameRE.MatchString(s) {
		return fmt.Errorf("%w: %s name %s: %s", ErrName, kind, Shown(s), NameRule)
	}
	return nil
}

// Payload checks that b is one JSON value of at most MaxPayloadBytes,
// nested at most MaxPayloadDepth deep.
func Payload(b []byte) error {
	if len(b) > MaxPayloadBytes {
		return fmt.Errorf("%w: %d bytes, more than the %d-byte limit", ErrTooLarge, len(b), MaxPayloadBytes)
	}
	if len(bytes.TrimSpace(b)) == 0 {
		return fmt.Errorf("%w: it is empty", ErrPayload)
	}
	if bytes.HasPrefix(b, []byte("\xef\xbb\xbf")) {
		return fmt.Errorf("%w: not JSON: it starts with a byte-order mark", ErrPayload)
	}
	if !json.Valid(b) {
		return fmt.Errorf("%w: not JSON: %s", ErrPayload, describeJSONError(b))
	}
	// encoding/json accepts invalid UTF-8 inside strings; PostgreSQL does
	// not take it at all.
	if !utf8.Valid(b) {
		return fmt.Errorf("%w: it is not valid UTF-8", ErrPayload)
	}
	sc := scan(b)
	if sc.depth > MaxPayloadDepth {
		return fmt.Errorf("%w: nested %d deep, more than %d", ErrPayload, sc.depth, MaxPayloadDepth)
	}
	// PostgreSQL's jsonb rejects the NUL character even when escaped.
	if sc.nul {
		return fmt.Errorf("%w: it contains \\u0000, which PostgreSQL's jsonb cannot store", ErrPayload)
	}
	// encoding/json reads an unpaired surrogate escape as U+FFFD; jsonb
	// refuses it. JavaScript's JSON.stringify writes one for a string
	// that was cut through a character.
	if sc.lone != "" {
		return fmt.Errorf("%w: it contains %s, half of a UTF-16 surrogate pair, which PostgreSQL's jsonb cannot store", ErrPayload, sc.lone)
	}
	if sc.badNumber != "" {
		return fmt.Errorf("%w: number %s is beyond the range of PostgreSQL's numeric (%d digits before the point, %d after)",
			ErrPayload, quote(sc.badNumber), maxNumericInt, maxNumericScale)
	}
	// The database's own check would refuse these too, but only after
	// building their text: a gigabyte from a payload of 100 KB. jsonb
	// keeps only the last of an object's duplicate keys, so a sum over
	// every number is counted again over those jsonb keeps.
	if sc.numbers > MaxPayloadBytes {
		if n := keptNumbers(b); n > MaxPayloadBytes {
			return fmt.Errorf("%w: its numbers alone are %d bytes as jsonb text, which writes them out in full (1e6 as 1000000), more than the %d-byte limit",
				ErrTooLarge, n, MaxPayloadBytes)
		}
	}
	return nil
}

// keptNumbers is the length of the numbers of valid JSON b as jsonb writes
// them, counting, as jsonb keeps, only the last value of a duplicate key.
// encoding/json keeps the last one too.
func keptNumbers(b []byte) int {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if dec.Decode(&v) != nil {
		return 0
	}
	var walk func(any) int
	walk = func(v any) int {
		n := 0
		switch x := v.(type) {
		case json.Number:
			n, _ = NumberText([]byte(x))
		case []any:
			for _, e := range x {
				n = min(n+walk(e), math.MaxInt32)
			}
		case map[string]any:
			for _, e := range x {
				n = min(n+walk(e), math.MaxInt32)
			}
		}
		return n
	}
	return walk(v)
}

// The range of PostgreSQL's numeric, in decimal digits.
const (
	maxNumericInt   = 131072    // before the point
	maxNumericScale = 16383     // after the point, trailing zeros included
	maxNumericExp   = 1<<30 - 2 // 14 and 15 refuse 1<<30 - 1, which 16 takes: the stricter holds everywhere
)

// NumberText returns the length of the text that PostgreSQL's numeric,
// and so jsonb, writes for the JSON number num, which it writes in full
// (1e3 as 1000, 1.50 as 1.50, 1e-3 as 0.001; -0 as 0), leaving out the
// sign; ok is false if num is beyond numeric's range.
func NumberText(num []byte) (n int, ok bool) {
	num = bytes.TrimPrefix(num, []byte("-"))
	mant, exp := num, []byte(nil)
	if i := bytes.IndexAny(num, "eE"); i >= 0 {
		mant, exp = num[:i], num[i+1:]
	}
	intPart, frac, _ := bytes.Cut(mant, []byte("."))
	var e int64
	if len(exp) > 0 {
		sign := int64(1)
		switch exp[0] {
		case '-':
			sign, exp = -1, exp[1:]
		case '+':
			exp = exp[1:]
		}
		exp = bytes.TrimLeft(exp, "0")
		if len(exp) > 10 {
			return 0, false
		}
		v, _ := strconv.ParseInt(string(exp), 10, 64) // "" (all zeros) is 0
		e = sign * v
	}
	if e > maxNumericExp || e < -maxNumericExp {
		return 0, false
	}
	scale := max(int64(len(frac))-e, 0)
	if scale > maxNumericScale {
		return 0, false
	}
	// Digits before the point: from the first significant one to the
	// point, moved by the exponent; at least the "0" of a zero or a value
	// below 1.
	digits := int64(1)
	if sig := bytes.TrimLeft(intPart, "0"); len(sig) > 0 {
		digits = max(int64(len(sig))+e, 1)
	} else if sig := bytes.TrimLeft(frac, "0"); len(sig) > 0 {
		digits = max(e-int64(len(frac)-len(sig)), 1)
	}
	if digits > maxNumericInt {
		return 0, false
	}
	if scale > 0 {
		return int(digits + 1 + scale), true
	}
	return int(digits), true
}

func describeJSONError(b []byte) string {
	var v any
	err := json.Unmarshal(b, &v)
	if err == nil {
		return "invalid JSON"
	}
	return err.Error()
}

// scanned is what scan finds in a JSON value.
type scanned struct {
	depth     int    // deepest nesting of arrays and objects
	nul       bool   // a string holds the escape \u0000
	lone      string // the first surrogate escape without its other half, if any
	numbers   int    // the length of the numbers as jsonb writes them (NumberText)
	badNumber string // the first number beyond numeric's range, if any
}

// scan walks valid JSON b once. An escaped backslash followed by "u0000"
// is not an escape of its own.
func scan(b []byte) scanned {
	var sc scanned
	var cur int
	inString, escaped := false, false
	pairedLow := -1 // index of the 'u' of a low surrogate escape paired with the high one before it
	numStart := -1  // index of the number being read, if any
	for i, c := range b {
		if numStart >= 0 {
			if c >= '0' && c <= '9' || c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-' {
				continue
			}
			sc.number(b[numStart:i])
			numStart = -1
		}
		switch {
		case inString:
			switch {
			case escaped:
				escaped = false
				if c != 'u' {
					break
				}
				r := hex4(b[i+1 : i+5]) // valid JSON: four hex digits follow
				switch {
				case r == 0:
					sc.nul = true
				case r >= 0xD800 && r <= 0xDBFF:
					if j := i + 5; j+6 <= len(b) && b[j] == '\\' && b[j+1] == 'u' && isLowSurrogate(hex4(b[j+2:j+6])) {
						pairedLow = j + 1
					} else if sc.lone == "" {
						sc.lone = `\` + string(b[i:i+5])
					}
				case r >= 0xDC00 && r <= 0xDFFF && i != pairedLow && sc.lone == "":
					sc.lone = `\` + string(b[i:i+5])
				}
			case c == '\\':
				escaped = true
			case c == '"':
				inString = false
			}
		case c == '"':
			inString = true
		case c == '-' || c >= '0' && c <= '9':
			numStart = i
		case c == '[' || c == '{':
			cur++
			sc.depth = max(sc.depth, cur)
		case c == ']' || c == '}':
			cur--
		}
	}
	if numStart >= 0 {
		sc.number(b[numStart:])
	}
	return sc
}

// number adds a number token to what scan found.
func (sc *scanned) number(num []byte) {
	n, ok := NumberText(num)
	switch {
	case !ok && sc.badNumber == "":
		sc.badNumber = string(num)
	case ok:
		sc.numbers = min(sc.numbers+n, math.MaxInt32) // many numbers of 131,072 digits
	}
}

// hex4 reads four hex digits.
func hex4(h []byte) rune {
	n, _ := strconv.ParseUint(string(h), 16, 32)
	return rune(n)
}

func isLowSurrogate(r rune) bool { return r >= 0xDC00 && r <= 0xDFFF }

// MaxAttemptsOption checks an optional max attempts: 0 means "use the
// default", otherwise 1 to MaxAttempts.
func MaxAttemptsOption(n int) error {
	if n < 0 || n > MaxAttempts {
		return fmt.Errorf("%w: max attempts %d is outside 1..%d (0 means the default)", ErrOption, n, MaxAttempts)
	}
	return nil
}

var epoch = time.Unix(0, 0)

// DeliverAt resolves a deliver-after time and a delay, of which at most one
// may be set, into an absolute time (zero: deliver now). Times in the past
// mean now (those before 1970 become zero); more than MaxDelay ahead is
// refused.
func DeliverAt(now, at time.Time, delay time.Duration) (time.Time, error) {
	switch {
	case !at.IsZero() && delay != 0:
		return time.Time{}, fmt.Errorf("%w: set a deliver-after time or a delay, not both", ErrOption)
	case delay < 0:
		return time.Time{}, fmt.Errorf("%w: delay %s is negative", ErrOption, delay)
	case delay > MaxDelay:
		return time.Time{}, fmt.Errorf("%w: delay %s is more than the limit, 87600h (10 years)", ErrOption, delay)
	case delay > 0:
		return now.Add(delay), nil
	case at.IsZero():
		return time.Time{}, nil
	case at.Sub(now) > MaxDelay:
		return time.Time{}, fmt.Errorf("%w: deliver-after %s is more than the limit, 87600h (10 years), ahead", ErrOption, at.Format(time.RFC3339))
	case at.Before(epoch):
		// Long past means now; PostgreSQL cannot store every past Go time.
		return time.Time{}, nil
	}
	return at, nil
}

// Duration checks that d lies within [min, max]; what names the setting.
func Duration(what string, d, min, max time.Duration) error {
	if d < min || d > max {
		return fmt.Errorf("%w: %s %s is outside %s..%s", ErrOption, what, d, min, max)
	}
	return nil
}

// Int checks that n lies within [min, max]; what names the setting.
func Int(what string, n, min, max int) error {
	if n < min || n > max {
		return fmt.Errorf("%w: %s %d is outside %d..%d", ErrOption, what, n, min, max)
	}
	return nil
}

// PushURL checks an HTTP push consumer's URL: absolute http or https,
// with a host, at most 2048 bytes, no user info (credentials in URLs end
// up in logs).
func PushURL(s string) error {
	u, err := url.Parse(s)
	shown := ShownURL(s)
	switch {
	case len(s) > 2048:
		return fmt.Errorf("%w: URL is %d bytes, more than 2048", ErrOption, len(s))
	case !utf8.ValidString(s):
		// The database refuses it, as a bare encoding error.
		return fmt.Errorf("%w: URL %s is not valid UTF-8", ErrOption, shown)
	case err != nil:
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // its text repeats the URL
		}
		return fmt.Errorf("%w: URL %s: %v", ErrOption, shown, err)
	case u.Scheme != "http" && u.Scheme != "https":
		return fmt.Errorf("%w: URL %s: scheme must be http or https", ErrOption, shown)
	case !strings.HasPrefix(s, u.Scheme+"://"):
		// url.Parse lowers the scheme; the table's constraint does not.
		return fmt.Errorf("%w: URL %s: write the scheme in lower case, %s://", ErrOption, shown, u.Scheme)
	case u.Hostname() == "":
		// Hostname, not Host: "http://:9/x" has a Host (":9") but nothing
		// to connect to, and the daemon refuses to serve it.
		return fmt.Errorf("%w: URL %s has no host", ErrOption, shown)
	case u.User != nil:
		return fmt.Errorf("%w: URL %s carries credentials; use the signing secret instead", ErrOption, shown)
	case strings.ContainsRune(s, ' ') || !printable.Is(s):
		// Listings show it: a bidi override there reorders it, a C1
		// control is a terminal's escape, spaces shift the columns.
		return fmt.Errorf("%w: URL %s holds a space or a character that is not printable; percent-encode it", ErrOption, shown)
	}
	if why := BadPort(u); why != "" {
		return fmt.Errorf("%w: URL %s: %s", ErrOption, shown, why)
	}
	return nil
}

// BadPort says why u's port can never be dialled, or "" if it can or u
// names none. url.Parse checks only that a port is digits, so a URL with
// port 99999 would be accepted, and every push to it fail.
func BadPort(u *url.URL) string {
	p := u.Port()
	if p == "" {
		return ""
	}
	if n, err := strconv.Atoi(p); err != nil || n < 1 || n > 65535 {
		return fmt.Sprintf("port %s is outside 1..65535", quote(p))
	}
	return ""
}

// ShownURL is s as errors about it may show it: quoted, with its user
// information (user name too: a token is often given as one) and its query
// and fragment (tokens too) replaced by placeholders, also when it does
// not parse, and not at all if it does not parse and has an "@". Errors
// are returned to callers and logged.
func ShownURL(s string) string { return quoteShown(redactURL(s)) }

// notShown stands for input that may carry credentials and cannot be cut
// down to what does not.
const notShown = "(not shown: it may carry credentials)"

// quoteShown quotes what a redaction left of some input; ok false is
// notShown.
func quoteShown(s string, ok bool) string {
	if !ok {
		return notShown
	}
	return quote(s)
}

// redactURL is ShownURL's redaction, unquoted; ok is false for a URL
// not to be shown at all.
func redactURL(s string) (shown string, ok bool) {
	u, err := url.Parse(s)
	switch {
	case err == nil && u.User == nil && (u.Opaque != "" || u.Host == "") && strings.Contains(s, "@"):
		// An "@" that url.Parse did not read as user information, having
		// found no "//" authority ("http:u:pw@host", "https:/u:pw@host"),
		// may still end a password.
		return "", false
	case err == nil:
		if u.User == nil && u.RawQuery == "" && !u.ForceQuery && u.Fragment == "" {
			// Nothing to hide: shown as written, since u.String() lowers
			// the scheme and drops an empty host's "//", which errors
			// about just those would then not show.
			return s, true
		}
		if u.User != nil {
			u.User = url.User("xxxxx")
		}
		if u.RawQuery != "" || u.ForceQuery {
			u.RawQuery, u.ForceQuery = "xxxxx", false
		}
		if u.Fragment != "" {
			u.Fragment, u.RawFragment = "xxxxx", ""
		}
		shown := u.String()
		// The scheme as written: url.Parse lowers it.
		if n := len(u.Scheme); n > 0 && len(s) >= n && strings.EqualFold(s[:n], shown[:n]) {
			shown = s[:n] + shown[n:]
		}
		return shown, true
	case strings.Contains(s, "@"):
		return "", false
	}
	// Unparsed, it may still carry a query or fragment token.
	if i := strings.IndexAny(s, "?#"); i >= 0 {
		return s[:i] + s[i:i+1] + "xxxxx", true
	}
	return s, true
}

// Shown is s as an error about a name or an argument may show it: quoted,
// escaped and cut short, as typed unless it may carry a password. A
// connection string typed where a name or an argument belongs (`bellhop
// app create postgres://u:pw@h/db`) is shown as pgdsn.Redact shows it,
// another URL as ShownURL does. Names never hold "://", "@" or "=", so a
// real mistake in one is still shown as typed, which is what the user
// looks for.
func Shown(s string) string { return quoteShown(Redact(s)) }

// Redact is s as Shown shows it, before quoting and cutting: as typed,
// or with what may be credentials replaced; ok is false when s is not to
// be shown at all (Shown then says so). For callers that quote and cut
// in their own way.
func Redact(s string) (shown string, ok bool) {
	lower := strings.ToLower(strings.TrimSpace(s))
	switch {
	case strings.HasPrefix(lower, "postgres://") || strings.HasPrefix(lower, "postgresql://"),
		strings.Contains(lower, "password") && strings.Contains(s, "="): // keyword/value settings
		return pgdsn.Redact(s), true
	case strings.Contains(s, "://") || strings.Contains(s, "@"):
		return redactURL(s)
	}
	return s, true
}

// quote prints untrusted input safely: quoted, escaped, and cut short.
func quote(s string) string {
	if len(s) > 64 {
		return fmt.Sprintf("%q… (%d bytes)", s[:64], len(s))
	}
	return fmt.Sprintf("%q", s)
}
