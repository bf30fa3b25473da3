package bellhop

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bellhopq/bellhop/internal/validate"
	"github.com/bellhopq/bellhop/migrations"
	queries "github.com/bellhopq/bellhop/sql"
)

// Client enqueues messages and manages apps, consumers and dead letters.
// It is safe for concurrent use.
//
// A Client from NewClient acts as an operator: it may act on every app. A
// Client from As acts as one principal and may act only on that
// principal's app.
type Client struct {
	db       *pgxpool.Pool
	operator bool      // made by NewClient
	actor    uuid.UUID // made by As: the principal acting
	// now is the clock that DeliverAfter is checked against (time.Now if
	// nil); tests set it to stand for a producer whose clock is off.
	now func() time.Time
}

// clock reads c's clock.
func (c *Client) clock() time.Time {
	if c.now != nil {
		return c.now()
	}
	return time.Now()
}

// NewClient returns an operator Client that runs its statements on db. The
// database must be migrated (see package migrations): on one without
// Bellhop's schema, a method's error wraps migrations.ErrNoSchema, and on
// one an older bellhop migrated, when a statement misses a table,
// function or column, migrations.ErrSchemaBehind. It panics if db is
// nil, as from a pgxpool.New whose error was dropped: every method would
// otherwise panic later, far from the cause. The zero Client is not
// usable; make one with NewClient.
func NewClient(db *pgxpool.Pool) *Client {
	if db == nil {
		panic("bellhop: NewClient: nil pool (did pgxpool.New fail?)")
	}
	return &Client{db: db, operator: true}
}

// As returns a Client acting as the principal with id principal. Every
// operation that names an existing app then fails with ErrForbidden
// unless the principal belongs to that app (one naming an app that does
// not exist, or an invalid name, fails with ErrUnknownApp, as for any
// Client); consumers it registers are registered by
// it, and messages it enqueues record it as their enqueuing principal.
// Bellhop gives no principal the id uuid.Nil, so a Client made with it (a
// failed lookup's zero value, say) is refused everything, unless a row
// with that id was written into principals by hand. The confinement binds
// what the Client does, not the code that holds it: that code has the
// pool, and its database role's rights, and may call As again.
func (c *Client) As(principal uuid.UUID) *Client {
	return &Client{db: c.db, actor: principal, now: c.now}
}

// principalArg is the acting principal as a statement argument: NULL for
// an operator, and the principal's id, even uuid.Nil, for As.
func (c *Client) principalArg() *uuid.UUID {
	if c.operator {
		return nil
	}
	p := c.actor
	return &p
}

// querier is what both a pool and a transaction offer.
type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// App is a tenant: it owns queues, consumers and principals.
type App struct {
	ID        uuid.UUID
	Name      string
	CreatedAt time.Time
	// DefaultPrincipal is the principal named "default", created with the
	// app; it acts for the app when no other principal is named.
	DefaultPrincipal uuid.UUID
}

// CreateApp creates an app and its "default" principal. Only an operator
// Client may: one made with As gets ErrForbidden.
func (c *Client) CreateApp(ctx context.Context, name string) (_ App, err error) {
	defer c.schemaError(ctx, &err)
	if err := validate.Name("app", name); err != nil {
		return App{}, fmt.Errorf("create app: %w", err)
	}
	if !c.operator {
		return App{}, fmt.Errorf("create app \"%s\": %w: principal %s may act on its own app only", printable(name), ErrForbidden, c.actor)
	}
	var a App
	err = c.db.QueryRow(ctx, queries.AppCreate, queries.Args{"name": name}).
		Scan(&a.ID, &a.Name, &a.CreatedAt, &a.DefaultPrincipal)
	if isUniqueViolation(err) {
		return App{}, fmt.Errorf("create app %q: %w", name, ErrAppExists)
	}
	if err != nil {
		return App{}, fmt.Errorf("create app %q: %w", name, err)
	}
	return a, nil
}

// Apps lists every app by name, or, for a Client made with As, its
// principal's app. DefaultPrincipal is not filled in.
func (c *Client) Apps(ctx context.Context) (_ []App, err error) {
	defer c.schemaError(ctx, &err)
	own, err := c.listApp(ctx, "")
	if err != nil {
		return nil, fmt.Errorf("list apps: %w", err)
	}
	rows, err := c.db.Query(ctx, queries.AppList)
	if err != nil {
		return nil, fmt.Errorf("list apps: %w", err)
	}
	apps, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (App, error) {
		var a App
		return a, r.Scan(&a.ID, &a.Name, &a.CreatedAt)
	})
	if err != nil {
		return nil, fmt.Errorf("list apps: %w", err)
	}
	if own != "" {
		apps = slices.DeleteFunc(apps, func(a App) bool { return a.Name != own })
	}
	return apps, nil
}

// listApp is the app a listing selects: app, or, when app is "", every
// app ("") for an operator and its principal's own app for a Client made
// with As, which must not see other apps' queues, consumers or dead
// letters.
func (c *Client) listApp(ctx context.Context, app string) (string, error) {
	if app != "" || c.operator {
		return app, nil
	}
	err := c.db.QueryRow(ctx, queries.PrincipalApp, queries.Args{"principal_id": c.actor}).Scan(&app)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", fmt.Errorf("%w: principal %s does not exist", ErrForbidden, c.actor)
	}
	return app, err
}

// CreatePrincipal adds a principal named name to app and returns its id.
// A Client made with As may add one to its own app only (ErrForbidden).
func (c *Client) CreatePrincipal(ctx context.Context, app, name string) (_ uuid.UUID, err error) {
	defer c.schemaError(ctx, &err)
	if err := validate.Name("principal", name); err != nil {
		return uuid.Nil, fmt.Errorf("create principal: %w", err)
	}
	if validate.Name("app", app) != nil {
		return uuid.Nil, fmt.Errorf("create principal \"%s\": %w", printable(name), unknownApp(app))
	}
	if !c.operator {
		if _, err := c.resolveApp(ctx, c.db, app); err != nil {
			return uuid.Nil, fmt.Errorf("create principal %q: %w", name, err)
		}
	}
	var id uuid.UUID
	err = c.db.QueryRow(ctx, queries.PrincipalCreate, queries.Args{"app_name": app, "principal_name": name}).Scan(&id)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return uuid.Nil, fmt.Errorf("create principal \"%s\": %w", printable(name), unknownApp(app))
	case isUniqueViolation(err):
		return uuid.Nil, fmt.Errorf("create principal \"%s\" in app \"%s\": %w", printable(name), printable(app), ErrPrincipalExists)
	case err != nil:
		return uuid.Nil, fmt.Errorf("create principal %q in app %q: %w", name, app, err)
	}
	return id, nil
}

// resolveApp turns an app name into its id for a call that acts on the
// app as a whole (its consumers, queues, dead letters; an empty batch):
// an operator needs only the app to exist, and a Client made with As its
// principal to belong to it. Found by review: these calls looked up the
// app's principal "default" too, which an app made by SQL, or whose
// default was renamed, lacks, and an operator could not so much as list
// its consumers.
func (c *Client) resolveApp(ctx context.Context, q querier, app string) (uuid.UUID, error) {
	appID, _, err := c.resolve(ctx, q, app, "")
	if c.operator && appID != uuid.Nil && errors.Is(err, ErrUnknownPrincipal) {
		return appID, nil
	}
	return appID, err
}

// resolve turns an app name into its id, and names the principal acting
// on it: the Client's own principal (which must belong to the app), or
// else the app's principal called principal ("" means "default"). For an
// operator whose app has no such principal, appID is set beside the
// error (resolveApp).
func (c *Client) resolve(ctx context.Context, q querier, app, principal string) (appID, principalID uuid.UUID, err error) {
	named := principal
	if principal == "" {
		principal = "default"
	}
	if validate.Name("app", app) != nil {
		return uuid.Nil, uuid.Nil, unknownApp(app)
	}
	if validate.Name("principal", principal) != nil {
		return uuid.Nil, uuid.Nil, unknownPrincipal(principal, app)
	}
	var pid *uuid.UUID
	var pname *string
	err = q.QueryRow(ctx, queries.PrincipalLookup, queries.Args{
		"app_name": app, "principal_name": principal, "principal_id": c.principalArg(),
	}).Scan(&appID, &pid, &pname)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return uuid.Nil, uuid.Nil, unknownApp(app)
	case err != nil:
		return uuid.Nil, uuid.Nil, err
	case pid == nil && !c.operator:
		return uuid.Nil, uuid.Nil, fmt.Errorf("%w: principal %s does not belong to app \"%s\"", ErrForbidden, c.actor, printable(app))
	case pid == nil:
		return appID, uuid.Nil, unknownPrincipal(principal, app)
	case !c.operator && named != "" && *pname != named:
		// Looked up by id, the client's own principal was found whatever
		// name was asked for: naming another is not allowed.
		return uuid.Nil, uuid.Nil, fmt.Errorf("%w: a client acting as principal %s (\"%s\") cannot act as principal \"%s\"",
			ErrForbidden, c.actor, printable(*pname), printable(named))
	}
	return appID, *pid, nil
}

func pgCode(err error) (code, constraint string) {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code, pe.ConstraintName
	}
	return "", ""
}

func isUniqueViolation(err error) bool {
	code, _ := pgCode(err)
	return code == "23505"
}

// schemaError is the last word on every error a Client method returns
// (each defers it): a statement of Bellhop's that found no table,
// function or column of its name (42P01 undefined_table, 42883
// undefined_function, 42703 undefined_column) means the database lacks Bellhop's schema, or has an older one than
// this code. It reads which from the schema version (migrations.Check, on
// the Client's pool, since a caller's transaction is aborted by then), and
// makes *err say so, wrapping migrations.ErrNoSchema or
// migrations.ErrSchemaBehind, with the database's error kept as detail,
// and still in the chain. With a current schema, or a version that cannot
// be read, the missing object is something else's doing (a search_path
// without public, say), and *err stays as it is.
func (c *Client) schemaError(ctx context.Context, err *error) {
	if code, _ := pgCode(*err); code != "42P01" && code != "42883" && code != "42703" {
		return
	}
	if errors.Is(*err, migrations.ErrNoSchema) || errors.Is(*err, migrations.ErrSchemaBehind) {
		return // a method called by another has said so already
	}
	why := migrations.Check(ctx, c.db)
	if errors.Is(why, migrations.ErrNoSchema) || errors.Is(why, migrations.ErrSchemaBehind) {
		*err = fmt.Errorf("%w (%w)", why, *err)
	}
}

// constraintError turns a violated table constraint into the typed error
// a caller can test for; other errors pass through.
func constraintError(err error) error {
	code, constraint := pgCode(err)
	switch code {
	case "23514":
	case "22P02", "22P05", "22003":
		// JSON that jsonb cannot hold: a lone surrogate, a number out of
		// numeric's range.
		return fmt.Errorf("%w: PostgreSQL's jsonb cannot store it (%w)", ErrInvalidPayload, err)
	default:
		return err
	}
	switch constraint {
	case "queue_messages_queue_name_check", "queue_trigger_details_queue_name_check":
		return fmt.Errorf("%w (%w)", ErrInvalidQueueName, err)
	case "queue_messages_payload_size_check", "outbox_payload_size_check":
		return fmt.Errorf("%w: over 1048576 bytes as jsonb text (%w)", ErrPayloadTooLarge, err)
	}
	return fmt.Errorf("%w (%w)", ErrInvalidOptions, err)
}
