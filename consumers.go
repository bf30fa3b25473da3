package bellhop

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/bellhopq/bellhop/internal/validate"
	queries "github.com/bellhopq/bellhop/sql"
)

// Consumer defaults, used where a ConsumerSpec leaves a field zero.
const (
	DefaultMaxAttempts       = 5
	DefaultBackoffBase       = time.Second
	DefaultBackoffCap        = 10 * time.Minute
	DefaultVisibilityTimeout = 30 * time.Second
	DefaultMaxInFlight       = 10
)

// ConsumerSpec describes a queue consumer to register. Zero fields take
// the defaults above.
type ConsumerSpec struct {
	App   string
	Queue string
	// Principal names the principal that registers the consumer; its
	// deliveries act as that principal. "" means the app's "default"; for
	// a Client made with As, it means that principal, and any other name
	// than its own is ErrForbidden. A name that breaks the naming rules
	// (1 to 63 bytes of [A-Za-z0-9._-], starting with a letter or digit)
	// is ErrUnknownPrincipal, for every Client.
	Principal string
	// MaxAttempts (1 to 1000) is the max_attempts, the deliveries before
	// it is dead-lettered, that a message enqueued to this queue while the
	// consumer exists gets when its producer chooses none
	// (EnqueueOptions.MaxAttempts 0), through Enqueue, EnqueueMany, the
	// CLI or the enqueue() SQL function; InvokeAsync's deliveries get it
	// the same way. The limit that counts is the message's own, fixed when
	// it is enqueued: a message enqueued before the consumer existed (3,
	// without one) or by a plain INSERT (the column default, 3) keeps its
	// own, as do queued messages when UpdateConsumer changes MaxAttempts,
	// and dead letters when they are redriven.
	MaxAttempts int
	// BackoffBase and BackoffCap shape the delay before attempt n+1:
	// min(BackoffCap, BackoffBase * 2^(n-1)), of which a random half is
	// jitter. Whole milliseconds: base from 1ms, cap up to 24h. A zero
	// BackoffCap is DefaultBackoffCap, or BackoffBase if that is longer.
	BackoffBase time.Duration
	BackoffCap  time.Duration
	// VisibilityTimeout is the lease on a claimed message, whole seconds
	// from 1s to 12h. The handler's context is cancelled, with cause
	// ErrLeaseLost, a fifth of it (at most 5s) before the lease ends,
	// unless Message.ExtendLease renews the lease first.
	VisibilityTimeout time.Duration
	// MaxInFlight bounds the messages handled at once, per dispatcher
	// process (1 to 10000): the queue's messages and the consumer's invoke
	// deliveries together.
	MaxInFlight int
	// URL makes this an HTTP push consumer: the daemon POSTs each message
	// there, signed with a secret generated at registration. "" means a
	// Go handler serves the queue. It is an absolute http or https URL of
	// at most 2048 bytes, with a host and no credentials, and holds no
	// space and nothing unprintable (percent-encode them).
	URL string
	// Timeout bounds each HTTP push request, in whole milliseconds from
	// 100ms. 0 means the visibility timeout minus its margin, so a request
	// ends before its lease; a longer one is refused, since the lease
	// would cut it short. Only a push consumer (URL set) takes one.
	Timeout time.Duration
}

// Consumer is a registered queue consumer. The settings it shares with
// ConsumerSpec mean what they mean there, defaults filled in.
type Consumer struct {
	ID    uuid.UUID
	AppID uuid.UUID
	App   string
	Queue string
	// PrincipalID is the principal its deliveries act as.
	PrincipalID uuid.UUID
	// Enabled is false while the consumer is paused (SetConsumerEnabled):
	// its messages stay queued.
	Enabled           bool
	MaxAttempts       int
	BackoffBase       time.Duration
	BackoffCap        time.Duration
	VisibilityTimeout time.Duration
	MaxInFlight       int
	CreatedAt         time.Time
	// LastFiredAt is about when a dispatcher last delivered to it (nil:
	// never). Dispatchers record it at most about once a second per
	// consumer; it is for people, not for scheduling.
	LastFiredAt *time.Time
	// URL and Timeout: see ConsumerSpec. Timeout 0 means the default.
	URL     string
	Timeout time.Duration
	// Secret is the HMAC-SHA256 key of an HTTP push consumer. It is set
	// only in the Consumer that RegisterConsumer or RotateConsumerSecret
	// returns (show it once) and in the one a dispatcher passes to its
	// Resolver; listings never carry it. JSON encoding leaves it out (as
	// String hides it), so a Consumer logged through a JSON logger
	// (zerolog's Interface, log/slog's JSONHandler) shows no secret; read
	// the field itself to hand it on.
	Secret string `json:"-"`
	// PreviousSecret is the secret that RotateConsumerSecret replaced,
	// while it still signs: requests carry a signature under each secret
	// until PreviousSecretUntil, so that a receiver can move to the new
	// one meanwhile. Like Secret, only a dispatcher's Resolver is given
	// it, and JSON encoding and String leave it out. "" when there is
	// none, or it no longer signs.
	PreviousSecret string `json:"-"`
	// PreviousSecretUntil is when the previous secret stops signing, in
	// listings too; zero when there is none, or it no longer signs (and
	// then left out of JSON).
	PreviousSecretUntil time.Time `json:",omitzero"`
}

func (s *ConsumerSpec) fill() {
	if s.MaxAttempts == 0 {
		s.MaxAttempts = DefaultMaxAttempts
	}
	if s.BackoffBase == 0 {
		s.BackoffBase = DefaultBackoffBase
	}
	if s.BackoffCap == 0 {
		s.BackoffCap = max(DefaultBackoffCap, s.BackoffBase)
	}
	if s.VisibilityTimeout == 0 {
		s.VisibilityTimeout = DefaultVisibilityTimeout
	}
	if s.MaxInFlight == 0 {
		s.MaxInFlight = DefaultMaxInFlight
	}
}

// String prints c's fields with its signing secret, if it has one,
// replaced by a placeholder: a Consumer printed or panicked with in a
// Resolver ends up in the log.
func (c Consumer) String() string {
	if c.Secret != "" {
		c.Secret = "xxxxx"
	}
	if c.PreviousSecret != "" {
		c.PreviousSecret = "xxxxx"
	}
	type plain Consumer // its fields, without this method
	return fmt.Sprintf("%+v", plain(c))
}

// GoString is String, for %#v.
func (c Consumer) GoString() string { return c.String() }

// Format writes String for every verb (GoString for %#v), so that no verb
// prints the fields, secret included, as %d or %x on the struct would.
func (c Consumer) Format(f fmt.State, verb rune) { formatAs(f, verb, c) }

func checkSettings(maxAttempts *int, base, capacity, vt *time.Duration, inFlight *int) error {
	if maxAttempts != nil {
		if err := validate.Int("max attempts", *maxAttempts, 1, validate.MaxAttempts); err != nil {
			return err
		}
	}
	if base != nil {
		if err := validate.Duration("backoff base", *base, time.Millisecond, validate.MaxBackoff); err != nil {
			return err
		}
	}
	if capacity != nil {
		if err := validate.Duration("backoff cap", *capacity, time.Millisecond, validate.MaxBackoff); err != nil {
			return err
		}
	}
	if err := whole("backoff base", base, time.Millisecond); err != nil {
		return err
	}
	if err := whole("backoff cap", capacity, time.Millisecond); err != nil {
		return err
	}
	if base != nil && capacity != nil && *capacity < *base {
		return fmt.Errorf("%w: backoff cap %s is below backoff base %s", ErrInvalidOptions, *capacity, *base)
	}
	if vt != nil {
		if err := validate.Duration("visibility timeout", *vt, validate.MinVisibility, validate.MaxVisibility); err != nil {
			return err
		}
		if err := whole("visibility timeout", vt, time.Second); err != nil {
			return err
		}
	}
	if inFlight != nil {
		if err := validate.Int("max in-flight", *inFlight, 1, validate.MaxInFlight); err != nil {
			return err
		}
	}
	return nil
}

func checkPush(url *string, timeout *time.Duration) error {
	if url != nil && *url != "" {
		if err := validate.PushURL(*url); err != nil {
			return err
		}
	}
	// A timeout of 0 means the default (and resets it in an update).
	if timeout != nil && *timeout != 0 {
		if err := validate.Duration("push timeout", *timeout, 100*time.Millisecond, validate.MaxVisibility); err != nil {
			return err
		}
		if err := whole("push timeout", timeout, time.Millisecond); err != nil {
			return err
		}
	}
	return nil
}

// whole refuses a setting d (if given) that is not a whole number of
// unit, the unit its column keeps: a finer one would be stored cut short,
// unlike what RegisterConsumer returned.
func whole(name string, d *time.Duration, unit time.Duration) error {
	if d == nil || *d%unit == 0 {
		return nil
	}
	units := "milliseconds"
	if unit == time.Second {
		units = "seconds"
	}
	return fmt.Errorf("%w: %s %s is not a whole number of %s", ErrInvalidOptions, name, *d, units)
}

// errTimeoutWithoutURL refuses a push timeout for a consumer served by a
// Go handler, where it would do nothing.
var errTimeoutWithoutURL = fmt.Errorf("%w: a push timeout applies only to an HTTP push consumer (one with a URL)", ErrInvalidOptions)

// checkPushFits refuses a push timeout that the lease would cut short: a
// request is abandoned when its handler's context ends, leaseMargin before
// the lease does, so a longer timeout would never be waited for.
func checkPushFits(timeout, vt time.Duration) error {
	if limit := vt - leaseMargin(vt); timeout > limit {
		return fmt.Errorf("%w: push timeout %s does not fit the visibility timeout %s: a push ends %s before its lease, so at most %s (or raise the visibility timeout)",
			ErrInvalidOptions, timeout, vt, leaseMargin(vt), limit)
	}
	return nil
}

// readCommitted is the isolation of the consumer changes' transactions,
// whatever the database's default: each takes a lock and then reads what
// the lock guards, which needs a snapshot taken after the lock. Under
// REPEATABLE READ the snapshot of the first statement, before the lock,
// let racing registrations make several consumers of one queue.
var readCommitted = pgx.TxOptions{IsoLevel: pgx.ReadCommitted}

// RegisterConsumer registers the consumer of spec.Queue. A queue has at
// most one consumer: a second registration fails with ErrConsumerExists,
// even when both race, because registrations of one (app, queue) are
// serialised by a transaction-scoped advisory lock.
func (c *Client) RegisterConsumer(ctx context.Context, spec ConsumerSpec) (_ Consumer, err error) {
	defer c.schemaError(ctx, &err)
	spec.fill()
	fail := func(err error) (Consumer, error) {
		return Consumer{}, fmt.Errorf("register consumer %s/%s: %w", printable(spec.App), printable(spec.Queue), err)
	}
	if err := validate.QueueName(spec.Queue); err != nil {
		return fail(err)
	}
	if err := checkSettings(&spec.MaxAttempts, &spec.BackoffBase, &spec.BackoffCap, &spec.VisibilityTimeout, &spec.MaxInFlight); err != nil {
		return fail(err)
	}
	if err := checkPush(&spec.URL, &spec.Timeout); err != nil {
		return fail(err)
	}
	if spec.URL == "" && spec.Timeout != 0 {
		return fail(errTimeoutWithoutURL)
	}
	if err := checkPushFits(spec.Timeout, spec.VisibilityTimeout); err != nil {
		return fail(err)
	}
	var out Consumer
	err = pgx.BeginTxFunc(ctx, c.db, readCommitted, func(tx pgx.Tx) error {
		appID, principalID, err := c.resolve(ctx, tx, spec.App, spec.Principal)
		if err != nil {
			return err
		}
		args := queries.Args{"app_id": appID, "queue_name": spec.Queue}
		if _, err := tx.Exec(ctx, queries.ConsumerLock, args); err != nil {
			return err
		}
		var existing uuid.UUID
		err = tx.QueryRow(ctx, queries.ConsumerFind, args).Scan(&existing)
		if err == nil {
			return fmt.Errorf("%w (consumer %s)", ErrConsumerExists, existing)
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return err
		}
		out = Consumer{
			AppID: appID, App: spec.App, Queue: spec.Queue, PrincipalID: principalID, Enabled: true,
			MaxAttempts: spec.MaxAttempts, BackoffBase: spec.BackoffBase, BackoffCap: spec.BackoffCap,
			VisibilityTimeout: spec.VisibilityTimeout, MaxInFlight: spec.MaxInFlight,
			URL: spec.URL, Timeout: spec.Timeout,
		}
		// The server makes a push consumer's signing secret and returns
		// it (consumer_insert.sql): sent as a parameter, it would be in
		// the log of a server that logs them (log_statement = all).
		var secret *string
		err = tx.QueryRow(ctx, queries.ConsumerInsert, queries.Args{
			"app_id": appID, "principal_id": principalID, "queue_name": spec.Queue,
			"max_attempts": spec.MaxAttempts, "backoff_base_ms": spec.BackoffBase.Milliseconds(),
			"backoff_cap_ms":          spec.BackoffCap.Milliseconds(),
			"visibility_timeout_secs": int(spec.VisibilityTimeout / time.Second), "max_in_flight": spec.MaxInFlight,
			"push_url":        nullable(spec.URL),
			"push_timeout_ms": nullable(spec.Timeout.Milliseconds()),
		}).Scan(&out.ID, &out.CreatedAt, &secret)
		if err != nil {
			return err
		}
		if secret != nil {
			out.Secret = *secret
		}
		return nil
	})
	if err != nil {
		return fail(constraintError(err))
	}
	return out, nil
}

// ConsumerUpdate changes some of a consumer's settings; nil fields stay.
// The settings take the values ConsumerSpec allows, except that URL cannot
// be added to a Go handler's consumer or removed from a push consumer, and
// that 0 means the default only for Timeout: for the other numbers it is
// ErrInvalidOptions, as below their ranges.
type ConsumerUpdate struct {
	// Enabled pauses (false) or resumes (true) the consumer.
	Enabled *bool
	// MaxAttempts changes the max_attempts that messages (and invoke
	// deliveries) enqueued from then on without their own get. Messages
	// already queued, and dead letters redriven later, keep the limit
	// they were enqueued with (ConsumerSpec.MaxAttempts).
	MaxAttempts       *int
	BackoffBase       *time.Duration
	BackoffCap        *time.Duration
	VisibilityTimeout *time.Duration
	MaxInFlight       *int
	URL               *string
	Timeout           *time.Duration
}

// UpdateConsumer changes the consumer id of app. Running dispatchers pick
// the change up within a moment: the update sends a notification that
// makes them reload their consumer list. A changed MaxAttempts is the
// exception: it applies to messages enqueued afterwards, not to those
// already queued (see ConsumerUpdate).
func (c *Client) UpdateConsumer(ctx context.Context, app string, id uuid.UUID, u ConsumerUpdate) (err error) {
	defer c.schemaError(ctx, &err)
	return c.updateConsumer(ctx, "update", app, id, u)
}

// updateConsumer is UpdateConsumer, whose errors begin with verb: a user
// who paused a consumer should not read that an update failed.
func (c *Client) updateConsumer(ctx context.Context, verb, app string, id uuid.UUID, u ConsumerUpdate) error {
	fail := func(err error) error {
		return fmt.Errorf("%s consumer %s of app %s: %w", verb, id, printable(app), err)
	}
	if err := checkSettings(u.MaxAttempts, u.BackoffBase, u.BackoffCap, u.VisibilityTimeout, u.MaxInFlight); err != nil {
		return fail(err)
	}
	if err := checkPush(u.URL, u.Timeout); err != nil {
		return fail(err)
	}
	if u.URL != nil && *u.URL == "" {
		return fail(fmt.Errorf("%w: URL \"\": a push consumer's URL cannot be removed (remove the consumer instead), and one served by a Go handler has none", ErrInvalidOptions))
	}
	appID, err := c.resolveApp(ctx, c.db, app)
	if err != nil {
		return fail(err)
	}
	if newTimeout := u.Timeout != nil && *u.Timeout != 0; u.URL != nil || newTimeout {
		cur, err := c.consumerByID(ctx, app, id)
		if err != nil {
			return fail(err)
		}
		switch {
		case cur.URL == "" && u.URL != nil:
			// A consumer served by a Go handler has no signing secret to
			// push with, and a secret made here could never be shown.
			return fail(fmt.Errorf("%w: the consumer is served by a Go handler; remove it and register a push consumer", ErrInvalidOptions))
		case cur.URL == "":
			return fail(errTimeoutWithoutURL)
		}
	}
	ms := func(d *time.Duration) *int64 {
		if d == nil {
			return nil
		}
		v := d.Milliseconds()
		return &v
	}
	var vt *int
	if u.VisibilityTimeout != nil {
		v := int(*u.VisibilityTimeout / time.Second)
		vt = &v
	}
	var n int64
	err = pgx.BeginTxFunc(ctx, c.db, readCommitted, func(tx pgx.Tx) error {
		if u.Timeout != nil || u.VisibilityTimeout != nil {
			if err := checkUpdatedTimeouts(ctx, tx, id, appID, u); err != nil {
				return err
			}
		}
		return tx.QueryRow(ctx, queries.ConsumerUpdate, queries.Args{
			"id": id, "app_id": appID, "enabled": u.Enabled, "max_attempts": u.MaxAttempts,
			"backoff_base_ms": ms(u.BackoffBase), "backoff_cap_ms": ms(u.BackoffCap),
			"visibility_timeout_secs": vt, "max_in_flight": u.MaxInFlight,
			"push_url": u.URL, "push_timeout_ms": ms(u.Timeout),
		}).Scan(&n)
	})
	if code, constraint := pgCode(err); code == "23514" && constraint == "triggers_backoff_cap_check" {
		return fail(c.backoffCapError(ctx, app, id, u))
	}
	if err != nil {
		return fail(constraintError(err))
	}
	if n == 0 {
		return fail(ErrUnknownConsumer)
	}
	return nil
}

// backoffCapError is UpdateConsumer's error for an update that the table's
// check refused because it would leave the backoff cap below the backoff
// base. checkSettings catches that when the update gives both, but not
// when it gives one and the consumer's other is in the way, and the bare
// constraint violation did not say which values. Like RegisterConsumer's
// error it names both, reading the one the update keeps.
func (c *Client) backoffCapError(ctx context.Context, app string, id uuid.UUID, u ConsumerUpdate) error {
	cur, err := c.consumerByID(ctx, app, id)
	if err != nil {
		return fmt.Errorf("%w: the backoff cap would be below the backoff base", ErrInvalidOptions)
	}
	base, capacity, kept := cur.BackoffBase, cur.BackoffCap, "base: lower it"
	if u.BackoffBase != nil {
		base, kept = *u.BackoffBase, "cap: raise it"
	}
	if u.BackoffCap != nil {
		capacity = *u.BackoffCap
	}
	return fmt.Errorf("%w: backoff cap %s is below backoff base %s (the consumer's current %s in the same update)",
		ErrInvalidOptions, capacity, base, kept)
}

// checkUpdatedTimeouts checks that the push timeout and visibility timeout
// that u leaves consumer id with still fit (checkPushFits), reading
// whichever of the two u keeps from the locked row.
func checkUpdatedTimeouts(ctx context.Context, tx pgx.Tx, id, appID uuid.UUID, u ConsumerUpdate) error {
	var (
		vtSecs    int
		timeoutMS *int64
	)
	err := tx.QueryRow(ctx, queries.ConsumerTimeouts, queries.Args{"id": id, "app_id": appID}).Scan(&vtSecs, &timeoutMS)
	if errors.Is(err, pgx.ErrNoRows) {
		return ErrUnknownConsumer
	}
	if err != nil {
		return err
	}
	vt := time.Duration(vtSecs) * time.Second
	if u.VisibilityTimeout != nil {
		vt = *u.VisibilityTimeout
	}
	var timeout time.Duration
	if timeoutMS != nil {
		timeout = time.Duration(*timeoutMS) * time.Millisecond
	}
	if u.Timeout != nil {
		timeout = *u.Timeout // 0 resets it to the default, which fits
	}
	return checkPushFits(timeout, vt)
}

// SetConsumerEnabled pauses (false) or resumes (true) a consumer. A paused
// consumer's messages stay queued; in-flight deliveries finish.
func (c *Client) SetConsumerEnabled(ctx context.Context, app string, id uuid.UUID, enabled bool) (err error) {
	defer c.schemaError(ctx, &err)
	verb := "pause"
	if enabled {
		verb = "resume"
	}
	return c.updateConsumer(ctx, verb, app, id, ConsumerUpdate{Enabled: &enabled})
}

// RemoveConsumer deletes the consumer id of app. Its queue's messages stay
// for a future consumer; its pending invoke_async deliveries are deleted,
// leased ones included.
//
// The removal is one statement, which deletes those deliveries row by row
// while a dispatcher may be recording outcomes for some of them in another
// order, so PostgreSQL may end it as a deadlock (40P01), or, in a session
// whose default isolation is repeatable read or serializable, as a
// serialization failure (40001). Either leaves everything as it was, and
// RemoveConsumer tries again, up to 4 times in all (removeTries); an error
// after the last says that nothing changed and to retry, the server's
// error wrapped.
func (c *Client) RemoveConsumer(ctx context.Context, app string, id uuid.UUID) (err error) {
	defer c.schemaError(ctx, &err)
	fail := func(err error) error {
		return fmt.Errorf("remove consumer %s of app %s: %w", id, printable(app), err)
	}
	appID, err := c.resolveApp(ctx, c.db, app)
	if err != nil {
		return fail(err)
	}
	for try := 1; ; try++ {
		var gone uuid.UUID
		err = c.db.QueryRow(ctx, queries.ConsumerDelete, queries.Args{"id": id, "app_id": appID}).Scan(&gone)
		switch {
		case err == nil:
			return nil
		case errors.Is(err, pgx.ErrNoRows):
			return fail(ErrUnknownConsumer)
		case !removalConflict(err):
			return fail(err)
		case try == removeTries:
			return fail(fmt.Errorf("a concurrent change of its invoke deliveries ended the removal %d times, "+
				"nothing changed; retry: %w", try, err))
		}
		// No pause: after a deadlock the other side holds the locks the
		// removal waited for, and the next try waits for it to end; after
		// a serialization failure the change met has committed, and the
		// next try's snapshot holds it.
	}
}

// removeTries bounds RemoveConsumer's tries of a removal that PostgreSQL
// ended for a deadlock or serialization failure.
const removeTries = 4

// removalConflict reports whether err is a deadlock (40P01) or a
// serialization failure (40001): the statement was rolled back, changed
// nothing, and may be tried again.
func removalConflict(err error) bool {
	code, _ := pgCode(err)
	return code == "40P01" || code == "40001"
}

// MaxKeepPreviousSecret bounds how long RotateConsumerSecret keeps the
// secret it replaces signing: a week, long enough to roll the new one out
// to a receiver's every instance, short enough that a forgotten rotation
// does not leave two secrets valid for good.
const MaxKeepPreviousSecret = 7 * 24 * time.Hour

// RotateConsumerSecret gives push consumer id of app a new signing secret
// and returns the consumer with it in Secret (show it once, as
// RegisterConsumer's). The consumer keeps its id, settings and deliveries.
//
// The secret it replaces goes on signing for keepPrevious, up to
// MaxKeepPreviousSecret: until then each request carries a v1 signature
// under each secret (Bellhop-Signature: v1=<new>,v1=<previous>), and a
// receiver that checks either (VerifyPush accepts any match) goes on
// accepting requests while it moves to the new one. 0 drops the old
// secret at once, for one that may have leaked. The returned Consumer's
// PreviousSecretUntil says when the old one stops signing.
//
// While an earlier rotation's previous secret still signs, only 0 is
// taken (ErrInvalidOptions otherwise, saying until when it signs):
// keeping the current secret would drop that one at once, and the
// receivers still on it would fail unwarned. 0 drops both.
//
// Running dispatchers pick the new secret up within a moment, as for
// UpdateConsumer; until they do, they sign with the old one alone. A
// consumer served by a Go handler has no secret: ErrInvalidOptions, as is
// a keepPrevious out of range or finer than a millisecond.
func (c *Client) RotateConsumerSecret(ctx context.Context, app string, id uuid.UUID, keepPrevious time.Duration) (_ Consumer, err error) {
	defer c.schemaError(ctx, &err)
	fail := func(err error) (Consumer, error) {
		return Consumer{}, fmt.Errorf("rotate secret of consumer %s of app %s: %w", id, printable(app), err)
	}
	if err := validate.Duration("keep previous secret", keepPrevious, 0, MaxKeepPreviousSecret); err != nil {
		return fail(err)
	}
	if err := whole("keep previous secret", &keepPrevious, time.Millisecond); err != nil {
		return fail(err)
	}
	appID, err := c.resolveApp(ctx, c.db, app)
	if err != nil {
		return fail(err)
	}
	var out Consumer
	err = pgx.BeginTxFunc(ctx, c.db, readCommitted, func(tx pgx.Tx) error {
		var until *time.Time
		err := tx.QueryRow(ctx, queries.ConsumerRotateSecret, queries.Args{
			"id": id, "app_id": appID, "keep_previous_ms": keepPrevious.Milliseconds(),
		}).Scan(&out.Secret, &until)
		if err != nil {
			return err
		}
		secret := out.Secret
		rows, err := tx.Query(ctx, queries.ConsumerGet, queries.Args{"id": id, "app_name": nil, "queue_name": nil, "with_secret": false})
		if err != nil {
			return err
		}
		if out, err = pgx.CollectExactlyOneRow(rows, scanConsumer); err != nil {
			return err
		}
		out.Secret = secret
		if until != nil {
			out.PreviousSecretUntil = *until
		}
		return nil
	})
	if errors.Is(err, pgx.ErrNoRows) {
		// No row changed (consumer_rotate_secret.sql says when). Read
		// after the transaction, which holds a connection, to say why.
		cur, err := c.consumerByID(ctx, app, id)
		switch {
		case err != nil:
		case cur.URL == "":
			err = fmt.Errorf("%w: the consumer is served by a Go handler, which has no signing secret", ErrInvalidOptions)
		case keepPrevious > 0 && !cur.PreviousSecretUntil.IsZero():
			err = fmt.Errorf("%w: keep previous secret %s: the secret an earlier rotation replaced signs until %s, and keeping the current one would stop it at once; "+
				"rotate again after then, or with 0 to stop both older secrets now",
				ErrInvalidOptions, keepPrevious, cur.PreviousSecretUntil.UTC().Format(time.RFC3339))
		case keepPrevious > 0:
			err = fmt.Errorf("%w: keep previous secret %s: the consumer has no signing secret to keep (its row was changed by hand); rotate with 0",
				ErrInvalidOptions, keepPrevious)
		default:
			err = ErrUnknownConsumer // removed, or moved to another app, meanwhile
		}
		return fail(err)
	}
	if err != nil {
		return fail(err)
	}
	return out, nil
}

// Consumers lists the consumers of app, or of every app when app is ""
// (of its principal's app, for a Client made with As).
// An app that does not exist is ErrUnknownApp (ErrForbidden, for a Client
// made with As, when it is another app), as in the methods that act on one.
func (c *Client) Consumers(ctx context.Context, app string) (_ []Consumer, err error) {
	defer c.schemaError(ctx, &err)
	app, err = c.listApp(ctx, app)
	if err != nil {
		return nil, fmt.Errorf("list consumers: %w", err)
	}
	var appArg *string
	if app != "" {
		if _, err := c.resolveApp(ctx, c.db, app); err != nil {
			return nil, fmt.Errorf("list consumers: %w", err)
		}
		appArg = &app
	}
	rows, err := c.db.Query(ctx, queries.ConsumerList, queries.Args{"app_name": appArg, "with_secret": false})
	if err != nil {
		return nil, fmt.Errorf("list consumers: %w", err)
	}
	out, err := pgx.CollectRows(rows, scanConsumer)
	if err != nil {
		return nil, fmt.Errorf("list consumers: %w", err)
	}
	return out, nil
}

// consumerByID returns the consumer id of app, or ErrUnknownConsumer.
func (c *Client) consumerByID(ctx context.Context, app string, id uuid.UUID) (Consumer, error) {
	rows, err := c.db.Query(ctx, queries.ConsumerGet, queries.Args{"id": id, "app_name": nil, "queue_name": nil, "with_secret": false})
	if err != nil {
		return Consumer{}, err
	}
	out, err := pgx.CollectExactlyOneRow(rows, scanConsumer)
	if errors.Is(err, pgx.ErrNoRows) || (err == nil && out.App != app) {
		return Consumer{}, ErrUnknownConsumer
	}
	return out, err
}

// ConsumerOf returns the consumer of app's queue, or ErrUnknownConsumer if
// it has none. An invalid queue name is ErrInvalidQueueName, an unknown app
// ErrUnknownApp, and, for a Client made with As, an app that is not its
// principal's ErrForbidden.
func (c *Client) ConsumerOf(ctx context.Context, app, queue string) (_ Consumer, err error) {
	defer c.schemaError(ctx, &err)
	fail := func(err error) (Consumer, error) {
		return Consumer{}, fmt.Errorf("consumer of %s/%s: %w", printable(app), printable(queue), err)
	}
	if err := validate.QueueName(queue); err != nil {
		return fail(err)
	}
	if _, err := c.resolveApp(ctx, c.db, app); err != nil {
		return fail(err)
	}
	rows, err := c.db.Query(ctx, queries.ConsumerGet, queries.Args{"id": nil, "app_name": app, "queue_name": queue, "with_secret": false})
	if err == nil {
		var out Consumer
		out, err = pgx.CollectExactlyOneRow(rows, scanConsumer)
		if err == nil {
			return out, nil
		}
		if errors.Is(err, pgx.ErrNoRows) {
			err = ErrUnknownConsumer
		}
	}
	return fail(err)
}

func scanConsumer(r pgx.CollectableRow) (Consumer, error) {
	var c Consumer
	var base, capacity int64
	var vt int
	var url, secret, previous *string
	var timeout *int64
	var previousUntil *time.Time
	err := r.Scan(&c.ID, &c.AppID, &c.App, &c.Queue, &c.PrincipalID, &c.Enabled, &c.MaxAttempts,
		&base, &capacity, &vt, &c.MaxInFlight, &c.CreatedAt, &c.LastFiredAt, &url, &timeout, &secret,
		&previous, &previousUntil)
	if url != nil {
		c.URL = *url
	}
	if secret != nil {
		c.Secret = *secret
	}
	if previous != nil {
		c.PreviousSecret = *previous
	}
	if previousUntil != nil {
		c.PreviousSecretUntil = *previousUntil
	}
	if timeout != nil {
		c.Timeout = time.Duration(*timeout) * time.Millisecond
	}
	c.BackoffBase = time.Duration(base) * time.Millisecond
	c.BackoffCap = time.Duration(capacity) * time.Millisecond
	c.VisibilityTimeout = time.Duration(vt) * time.Second
	return c, err
}
