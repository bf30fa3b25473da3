// Package sql holds every SQL statement Bellhop runs, one statement per
// .sql file in this folder, embedded at build time. Each file starts with a
// comment that says what the statement does and why it is safe under
// concurrency. Statements take named arguments (@name), passed as Args,
// which find each statement's placeholders once rather than on every call.
//
// Import it under another name, since it shares its name with database/sql:
//
//	import queries "github.com/bellhopq/bellhop/sql"
package sql

import _ "embed"

// Ack is ack.sql.
//
//go:embed ack.sql
var Ack string

// AppCreate is app_create.sql.
//
//go:embed app_create.sql
var AppCreate string

// AppList is app_list.sql.
//
//go:embed app_list.sql
var AppList string

// BusyClear is busy_clear.sql.
//
//go:embed busy_clear.sql
var BusyClear string

// BusyHold is busy_hold.sql.
//
//go:embed busy_hold.sql
var BusyHold string

// BusyLock is busy_lock.sql.
//
//go:embed busy_lock.sql
var BusyLock string

// BusyMark is busy_mark.sql.
//
//go:embed busy_mark.sql
var BusyMark string

// BusyRelease is busy_release.sql.
//
//go:embed busy_release.sql
var BusyRelease string

// BusyUnmark is busy_unmark.sql.
//
//go:embed busy_unmark.sql
var BusyUnmark string

// ClaimInvoke is claim_invoke.sql.
//
//go:embed claim_invoke.sql
var ClaimInvoke string

// ClaimQueue is claim_queue.sql.
//
//go:embed claim_queue.sql
var ClaimQueue string

// ClaimQueues is claim_queues.sql.
//
//go:embed claim_queues.sql
var ClaimQueues string

// ConsumerDelete is consumer_delete.sql.
//
//go:embed consumer_delete.sql
var ConsumerDelete string

// ConsumerFind is consumer_find.sql.
//
//go:embed consumer_find.sql
var ConsumerFind string

// ConsumerGet is consumer_get.sql.
//
//go:embed consumer_get.sql
var ConsumerGet string

// ConsumerInsert is consumer_insert.sql.
//
//go:embed consumer_insert.sql
var ConsumerInsert string

// ConsumerList is consumer_list.sql.
//
//go:embed consumer_list.sql
var ConsumerList string

// ConsumerLock is consumer_lock.sql.
//
//go:embed consumer_lock.sql
var ConsumerLock string

// ConsumerRotateSecret is consumer_rotate_secret.sql.
//
//go:embed consumer_rotate_secret.sql
var ConsumerRotateSecret string

// ConsumerSecretMatches is consumer_secret_matches.sql.
//
//go:embed consumer_secret_matches.sql
var ConsumerSecretMatches string

// ConsumerTimeouts is consumer_timeouts.sql.
//
//go:embed consumer_timeouts.sql
var ConsumerTimeouts string

// ConsumerUpdate is consumer_update.sql.
//
//go:embed consumer_update.sql
var ConsumerUpdate string

// DeadLetter is dead_letter.sql.
//
//go:embed dead_letter.sql
var DeadLetter string

// DeadList is dead_list.sql.
//
//go:embed dead_list.sql
var DeadList string

// DeadListBrief is dead_list_brief.sql.
//
//go:embed dead_list_brief.sql
var DeadListBrief string

// DeadPurge is dead_purge.sql.
//
//go:embed dead_purge.sql
var DeadPurge string

// DeadRedrive is dead_redrive.sql.
//
//go:embed dead_redrive.sql
var DeadRedrive string

// DemoDeadLetters is demo_dead_letters.sql.
//
//go:embed demo_dead_letters.sql
var DemoDeadLetters string

// Enqueue is enqueue.sql.
//
//go:embed enqueue.sql
var Enqueue string

// EnqueueOversized is enqueue_oversized.sql.
//
//go:embed enqueue_oversized.sql
var EnqueueOversized string

// EnqueueOne is enqueue_one.sql.
//
//go:embed enqueue_one.sql
var EnqueueOne string

// Extend is extend.sql.
//
//go:embed extend.sql
var Extend string

// GenericPlans is generic_plans.sql.
//
//go:embed generic_plans.sql
var GenericPlans string

// HandOver is hand_over.sql.
//
//go:embed hand_over.sql
var HandOver string

// Invoke is invoke.sql.
//
//go:embed invoke.sql
var Invoke string

// LeaseKeyHold is lease_key_hold.sql.
//
//go:embed lease_key_hold.sql
var LeaseKeyHold string

// ListenerCover is listener_cover.sql.
//
//go:embed listener_cover.sql
var ListenerCover string

// ListenerSession is listener_session.sql.
//
//go:embed listener_session.sql
var ListenerSession string

// MessageDelete is message_delete.sql.
//
//go:embed message_delete.sql
var MessageDelete string

// MessageFind is message_find.sql.
//
//go:embed message_find.sql
var MessageFind string

// MessageGet is message_get.sql.
//
//go:embed message_get.sql
var MessageGet string

// Nack is nack.sql.
//
//go:embed nack.sql
var Nack string

// NextDueInvoke is next_due_invoke.sql.
//
//go:embed next_due_invoke.sql
var NextDueInvoke string

// NextDueQueue is next_due_queue.sql.
//
//go:embed next_due_queue.sql
var NextDueQueue string

// NextDueQueues is next_due_queues.sql.
//
//go:embed next_due_queues.sql
var NextDueQueues string

// NextLeaseExpiry is next_lease_expiry.sql.
//
//go:embed next_lease_expiry.sql
var NextLeaseExpiry string

// OfferDrop is offer_drop.sql.
//
//go:embed offer_drop.sql
var OfferDrop string

// OfferDropAll is offer_drop_all.sql.
//
//go:embed offer_drop_all.sql
var OfferDropAll string

// OfferDropAllWait is offer_drop_all_wait.sql.
//
//go:embed offer_drop_all_wait.sql
var OfferDropAllWait string

// OfferMake is offer_make.sql.
//
//go:embed offer_make.sql
var OfferMake string

// OfferRecover is offer_recover.sql.
//
//go:embed offer_recover.sql
var OfferRecover string

// Poll is poll.sql.
//
//go:embed poll.sql
var Poll string

// PrincipalCreate is principal_create.sql.
//
//go:embed principal_create.sql
var PrincipalCreate string

// PrincipalApp is principal_app.sql.
//
//go:embed principal_app.sql
var PrincipalApp string

// PrincipalList is principal_list.sql.
//
//go:embed principal_list.sql
var PrincipalList string

// PrincipalLookup is principal_lookup.sql.
//
//go:embed principal_lookup.sql
var PrincipalLookup string

// QueueList is queue_list.sql.
//
//go:embed queue_list.sql
var QueueList string

// QueuePurge is queue_purge.sql.
//
//go:embed queue_purge.sql
var QueuePurge string

// Reclaim is reclaim.sql.
//
//go:embed reclaim.sql
var Reclaim string

// Release is release.sql.
//
//go:embed release.sql
var Release string

// TouchLastFired is touch_last_fired.sql.
//
//go:embed touch_last_fired.sql
var TouchLastFired string

// WakeScan is wake_scan.sql.
//
//go:embed wake_scan.sql
var WakeScan string
