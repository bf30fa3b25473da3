// Package bellhop is a PostgreSQL-native durable queue with a push
// dispatcher.
//
// Producers put messages into per-app named queues: rows in
// queue_messages, identified by (app, queue). An insert trigger sends one
// notification per (app, queue) a transaction touched, at COMMIT, and none
// while a dispatcher is busy with that queue and polls it instead. With
// DispatcherConfig.LeaseAtInsert, the trigger may lease the message to an
// idle dispatcher and send it on that dispatcher's own channel instead. A
// Dispatcher listens for them, claims messages with FOR UPDATE SKIP LOCKED
// under a visibility timeout, and pushes each one to the queue's single
// registered consumer, a Handler. Delayed messages wake the dispatcher by
// timer, a slow fallback poll catches anything a lost notification missed,
// and expired leases are reclaimed, so a crashed consumer loses no work.
// Messages that use up their attempts go to a dead-letter table.
//
// A Client enqueues and administers apps, consumers and dead letters; a
// Dispatcher delivers. A Client works on a pgxpool.Pool of the caller's. A
// Dispatcher takes a pgxpool.Config and opens its own pool from it, plus
// one connection for LISTEN and, the first time a queue is busy, one for
// its busy locks. The examples put them together: a producer and a
// dispatcher, the transactional outbox, a dead letter and its redrive,
// and an HTTP consumer's check of a push.
package bellhop
