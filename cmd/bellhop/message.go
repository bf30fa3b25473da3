package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"

	"github.com/google/uuid"
	"github.com/urfave/cli/v3"

	"github.com/bellhopq/bellhop"
	"github.com/bellhopq/bellhop/internal/printable"
	"github.com/bellhopq/bellhop/internal/validate"
)

// messageCommand deletes queue messages that wait for delivery: one that
// should never have been enqueued, or a queue's backlog that no consumer
// should get (a bad batch, a test run). Without it, the only way was SQL
// against queue_messages, which could also delete a message being
// delivered under its handler. Messages in flight are left to their
// delivery by both commands, as the library leaves them.
func messageCommand(d *deps) *cli.Command {
	appFlag := &cli.StringFlag{Name: "app", Usage: "app name (required)", Required: true, Sources: env("APP")}
	return &cli.Command{
		Name:  "message",
		Usage: "show a queue message, or delete those that wait for delivery",
		Commands: []*cli.Command{{
			Name: "show",
			Usage: "show a queue message in full, as JSON: waiting for delivery (ClaimedAt null) or being delivered, under a lease taken or renewed at ClaimedAt; " +
				"a dead one is in bellhop dead show",
			ArgsUsage: "MESSAGE_ID",
			Flags:     []cli.Flag{appFlag},
			Action: byID(func(ctx context.Context, c *bellhop.Client, app string, id uuid.UUID) error {
				m, err := c.QueuedMessage(ctx, app, id)
				if err != nil {
					return err
				}
				v := shownMessage(m)
				var buf bytes.Buffer
				enc := json.NewEncoder(&buf)
				enc.SetIndent("", "  ")
				if err := encodeShown(enc, d.stderr, &v, m.ID, &v.Payload); err != nil {
					return err
				}
				// A payload is a producer's text: bidi overrides and C1
				// controls in it are escaped too, as in dead show.
				_, err = d.stdout.Write(printable.JSON(buf.Bytes()))
				return err
			}),
		}, {
			Name: "rm",
			Usage: "delete one queue message that waits for delivery (ready, delayed or waiting for a retry), for good, " +
				"with no dead letter; one being delivered is left to its delivery",
			ArgsUsage: "MESSAGE_ID",
			Flags:     []cli.Flag{appFlag},
			Action: byID(func(ctx context.Context, c *bellhop.Client, app string, id uuid.UUID) error {
				// ErrUnknownMessage exits 2 (badInput); ErrMessageInFlight
				// exits 1, as a retry once the delivery has failed may
				// succeed, and its text says when.
				if err := c.DeleteMessage(ctx, app, id); err != nil {
					return err
				}
				fmt.Fprintf(d.stdout, "deleted message %s\n", id)
				return nil
			}),
		}, {
			Name: "purge",
			Usage: "delete every message of a queue that waits for delivery and was enqueued before the purge began, for good, " +
				"with no dead letters; those being delivered are left to their delivery",
			Flags: []cli.Flag{appFlag, &cli.StringFlag{Name: "queue", Usage: "queue name (required)", Required: true}},
			Action: func(ctx context.Context, cmd *cli.Command) error {
				// Checked before connecting, so that a bad name is named
				// even with the database away.
				if err := checkAppFlag(cmd); err != nil {
					return err
				}
				app, queue := cmd.String("app"), cmd.String("queue")
				if err := validate.QueueName(queue); err != nil {
					return usagef("--queue: %w", err)
				}
				c, pool, err := client(ctx, cmd)
				if err != nil {
					return err
				}
				defer pool.Close()
				n, err := c.PurgeQueue(ctx, app, queue)
				if err != nil {
					if n > 0 {
						// Batches before the failed one stay deleted: running
						// the purge again deletes the rest.
						fmt.Fprintf(d.stdout, "purged %s of %s/%s before the error\n", plural(int(n), "message"), app, queue)
					}
					return err
				}
				line := fmt.Sprintf("purged %s of %s/%s", plural(int(n), "message"), app, queue)
				// A purge that leaves messages behind says so: a queue
				// that `bellhop queues` still shows busy would otherwise
				// look like a purge that failed.
				if q, ok := queueAfter(ctx, c, app, queue); ok {
					if m := q.InFlight; m > 0 {
						their := "their"
						if m == 1 {
							their = "its"
						}
						line += fmt.Sprintf("; %d in flight left to %s delivery", m, their)
					}
					if w := q.Ready + q.Delayed; w > 0 {
						line += fmt.Sprintf("; %d waiting left (enqueued since the purge began, or invoke deliveries, which it does not delete)", w)
					}
				}
				fmt.Fprintln(d.stdout, line)
				return nil
			},
		}},
	}
}

// byID is the action of a message command that takes a MESSAGE_ID:
// MESSAGE_ID (the nil UUID refused too, as by the dead-letter commands:
// it is no message's id) and --app are checked before connecting, then
// op runs.
func byID(op func(ctx context.Context, c *bellhop.Client, app string, id uuid.UUID) error) cli.ActionFunc {
	return func(ctx context.Context, cmd *cli.Command) error {
		id, err := messageArg(cmd)
		if err != nil {
			return err
		}
		if err := checkAppFlag(cmd); err != nil {
			return err
		}
		c, pool, err := client(ctx, cmd)
		if err != nil {
			return err
		}
		defer pool.Close()
		return op(ctx, c, cmd.String("app"), id)
	}
}

// messageView is a QueuedMessage as message show prints it: the same
// fields in the same order, its times as RFC 3339 text in UTC, as
// deadView.
type messageView struct {
	ID           uuid.UUID
	App          string
	Queue        string
	Payload      json.RawMessage
	EnqueuedAt   string
	DeliverAfter *string
	Attempt      int
	MaxAttempts  int
	EnqueuedBy   *uuid.UUID
	ClaimedAt    *string
}

func shownMessage(m bellhop.QueuedMessage) messageView {
	return messageView{ID: m.ID, App: m.App, Queue: m.Queue, Payload: m.Payload,
		EnqueuedAt: *shownAt(&m.EnqueuedAt), DeliverAfter: shownAt(m.DeliverAfter), Attempt: m.Attempt,
		MaxAttempts: m.MaxAttempts, EnqueuedBy: m.EnqueuedBy, ClaimedAt: shownAt(m.ClaimedAt)}
}

// queueAfter reads app's queue as `bellhop queues` shows it, for the line
// of a purge that has succeeded: not ok when it cannot be read (or the
// queue is empty), so that the purge's report does not turn into a
// failure over a note.
func queueAfter(ctx context.Context, c *bellhop.Client, app, queue string) (bellhop.QueueInfo, bool) {
	qs, err := c.Queues(ctx, app)
	if err != nil {
		return bellhop.QueueInfo{}, false
	}
	for _, q := range qs {
		if q.Queue == queue {
			return q, true
		}
	}
	return bellhop.QueueInfo{}, false
}
