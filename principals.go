package bellhop

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	queries "github.com/bellhopq/bellhop/sql"
)

// Principal is one of an app's identities, which register consumers and
// enqueue messages; a Client made with As acts as one. Every app has one
// named "default", made with the app (App.DefaultPrincipal); others are
// made with CreatePrincipal.
type Principal struct {
	ID        uuid.UUID
	App       string
	Name      string
	CreatedAt time.Time
}

// Principals lists the principals of app, or of every app when app is ""
// (of its principal's app, for a Client made with As), by app and name.
// An app that does not exist is ErrUnknownApp (ErrForbidden, for a Client
// made with As, when it is another app), as in the methods that act on one.
func (c *Client) Principals(ctx context.Context, app string) (_ []Principal, err error) {
	defer c.schemaError(ctx, &err)
	app, err = c.listApp(ctx, app)
	if err != nil {
		return nil, fmt.Errorf("list principals: %w", err)
	}
	if app != "" {
		if _, err := c.resolveApp(ctx, c.db, app); err != nil {
			return nil, fmt.Errorf("list principals: %w", err)
		}
	}
	rows, err := c.db.Query(ctx, queries.PrincipalList, queries.Args{"app_name": nullable(app)})
	if err != nil {
		return nil, fmt.Errorf("list principals: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Principal, error) {
		var p Principal
		return p, r.Scan(&p.ID, &p.App, &p.Name, &p.CreatedAt)
	})
	if err != nil {
		return nil, fmt.Errorf("list principals: %w", err)
	}
	return out, nil
}
