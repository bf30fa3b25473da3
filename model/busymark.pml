/*
 * busymark.pml -- Promela model of Bellhop's busy-mark protocol (issue 7),
 * in its hybrid form (migration 0042): producers skip pg_notify while a
 * dispatcher holds the queue's busy LOCK B (a session advisory lock), and
 * dispatchers learn of each other through their busy ROWS (queue_busy) and
 * through B.  No wake-up may be lost.  README.md beside this file maps the
 * model to the SQL/Go code and gives the abstractions and the results.
 *
 * One queue; NMSG producer transactions of one message each, at most NPROD
 * of them open at once (NPROD concurrent producers); ND = 2 dispatchers
 * that claim up to CAP messages per pass; at most one dispatcher failure
 * (a crash, or a clean stop); busy rows that may expire at any moment; a
 * busy-lock session that the server may drop at any moment without its
 * dispatcher knowing, and whose dying backend may hold B a while longer;
 * notifications delivered some time after the commit that sends them.
 *
 * Properties (choose with pan -N):
 *   safe   [] (QUIESCENT -> ALLCLAIMED)            (pan compiled -DSAFETY)
 *          "quiescent => all claimed": once every producer has committed
 *          and every live dispatcher sleeps with no wake-up pending and no
 *          watch timer armed, every message has been claimed.  A message
 *          left unclaimed while everybody sleeps is a lost wake-up.
 *   liveness  <> ALLCLAIMED                         (pan -a -f)
 *          under weak fairness every committed message is eventually
 *          claimed with no fallback poll, while a dispatcher lives.
 * and in-line assertions: no message is claimed twice (the claimed,
 * locked and visible counts always add up to the committed ones), at most
 * one session holds B, a lane only sleeps after releasing B and deleting
 * its own row.
 *
 * Compile-time switches.  By default the model is the protocol as
 * specified plus the fixes the model showed necessary; each FLAW_* switch
 * restores one deviation: a deliberately broken protocol, or the
 * specification's literal wording where the model showed that it loses
 * wake-ups (README.md, "Findings"):
 *   FLAW_NO_LOCKWAIT    settle skips step (b): no exclusive try of K
 *   FLAW_EARLY_READ     producer tests B before taking K shared
 *   FLAW_NO_FREE_CHECK  after an unconfirmed release of B (its session was
 *                       dropped), settle only waits for K, not also for B
 *                       to be free
 *   FLAW_WATCH_ROW_ONLY a pass reports a foreign mark only from the other
 *                       dispatcher's row, never from B held by another
 *                       session
 *   FLAW_HOLD_SILENT    (brief, literal) taking B sends nothing: the other
 *                       dispatchers learn of a busy lane only from its new
 *                       row's notification
 *   FLAW_TIMER_IDLE     a watch timer that finds no live mark sleeps again
 *                       without settling
 *   FLAW_SETTLE_MARK    (spec) a pass run while settle step (b) waits, that
 *                       fills its capacity, sets the row and stays in SETTLE
 *   FLAW_LAST_PASS      (spec) the watch timer is armed only from the last
 *                       pass before sleeping; earlier passes' sightings of a
 *                       foreign mark are forgotten
 *   FLAW_WAKE_IDLE      (spec) a wake-up pass that claims nothing and sees no
 *                       live foreign mark sleeps at once, without settling
 *   FLAW_SKIP           a pass that claimed nothing ignores ready rows that it
 *                       skipped (FOR UPDATE SKIP LOCKED) because another
 *                       claimer held them: if that claimer dies before it
 *                       commits, the rows are stranded
 * Variants of the fixed protocol, also checked:
 *   MARK_NEXT    as lane.go does it: a pass that fills the lane's slots makes
 *                the lane busy, and B is tried and the row upserted from the
 *                NEXT pass on (the first one included), not by the filling one
 *   (default)    a steady stream: any pass that claims something may make
 *                the lane busy, not only one that fills its slots (lane.go
 *                decides by time, BusyWindow; the model by free choice), and
 *                a busy lane may make up to LINGER empty passes before it
 *                settles (lane.go polls until the queue has been empty for
 *                a window).  NO_STREAM: only filling passes mark, and the
 *                first empty busy pass settles
 *   MARK_WATCH   the cheaper form of the FLAW_WAKE_IDLE fix: a new mark's
 *                notification ('b:') is told apart from a message's and makes
 *                the receiving lane's watch timer due (lane.watching = true);
 *                a plain wake-up that finds nothing then sleeps at once
 *   HOLD_ERR_FORGET  a take of B that fails with an error (the server
 *                granted B and sent its notification, then the connection
 *                broke before the reply) is forgotten: the lane reports
 *                its release as confirmed (internal/busylock Hold did
 *                this until 2026-12-04).  No loss: the lane's next pass
 *                sees the dying backend's hold as foreign and watches it,
 *                but in the code that watch looks again only BusyLease
 *                later (model/README.md, D)
 *   NO_ROW_NOTIFY  a newly inserted row does not wake the others (the
 *                FLAW_NO_NEW_NOTIFY of the row protocol: no longer a flaw,
 *                since taking B notifies)
 *   NO_ROW       dispatchers write no queue_busy rows at all: watchers
 *                learn of a busy lane from B's notification and see B only
 * Model switches:
 *   ATOMIC_PASS  a pass is one indivisible step (no mid-pass crash, no
 *                skipped rows)
 *   SYNC_NOTIFY  a notification sets the wake flags at commit
 *   NO_FAILURE   no dispatcher crashes or stops
 *   CRASH_ONLY, STOP_ONLY   the failure can only be a crash, or a clean stop
 *   NO_EXPIRY    rows never expire (they are only deleted)
 *   NMSG, NPROD, CAP, LINGER  sizes (defaults 3, 2, 1, 1)
 *   NDROP        how many times the server may drop a live dispatcher's
 *                lock session (default 1; 0: never)
 */

/* Events printed when a counterexample is replayed (spin -t); NO_EV drops
 * them, to confirm that they do not change the state space. */
#ifdef NO_EV
#define EV(...) skip
#else
#define EV(...) printf(__VA_ARGS__)
#endif

#ifndef NMSG
#define NMSG 3          /* producer transactions, one message each */
#endif
#ifndef NPROD
#define NPROD 2         /* producer transactions open at once */
#endif
#ifndef CAP
#define CAP 1           /* free slots of a lane: messages per claim pass */
#endif
#ifndef LINGER
#define LINGER 1        /* empty passes a busy lane may make before it settles */
#endif
#ifndef NDROP
#define NDROP 1         /* lock sessions of live dispatchers the server drops */
#endif
#define ND 2            /* dispatchers 0 and 1; d's other is 1-d */

/* Messages of the one queue.  They are interchangeable for wake-ups, so the
 * model counts them instead of naming them. */
byte vis;               /* committed, unclaimed, not locked by a claim */
byte lk[ND];            /* locked by dispatcher d's uncommitted claim pass */
byte nclaimed;          /* claimed (claim committed) */
byte ncommitted;        /* committed by producers */

/* Producer transactions, counted by step (interchangeable too). */
byte pnew = NMSG;       /* not begun */
byte plock;             /* INSERTed, hold K shared, B not tested yet */
byte ptell;             /* hold K shared, B was free: will notify */
byte pquiet;            /* hold K shared, B was held: will not notify */
#ifdef FLAW_EARLY_READ
byte etell, equiet;     /* tested B (free / held), no K yet */
#endif

bool live[ND];          /* queue_busy: owner d has a LIVE row */
bool held[ND];          /* dispatcher d's lock session holds B exclusively */
bool gh;                /* B held by the dying backend of a lock session that
                         * ended: a dropped session, or that of a dispatcher
                         * that crashed or stopped (whose it is does not
                         * matter: every dispatcher sees it as foreign) */
#if NDROP > 0
byte drops;             /* lock sessions dropped so far */
#endif
#define BHELD (held[0] || held[1] || gh)

bool pend[ND];          /* a notification for lane d is on its way */
#ifdef MARK_WATCH
bool pendm[ND];         /* a new-mark notification for lane d is on its way */
#endif
bool wake[ND];          /* lane d's capacity-1 wake channel */
byte watch[ND];         /* lane d's watch timer on the other's mark */
#ifdef FLAW_LAST_PASS
byte pw[ND];            /* the watch the last pass would arm (spec, literal) */
#endif
byte st[ND];            /* S_IDLE while lane d sleeps */
bool dead[ND];          /* dispatcher d crashed or stopped */

#define S_RUN  0
#define S_IDLE 1
/* watch timer: none; armed (the watched mark is not over); due (may fire) */
#define W_NONE  0
#define W_ARMED 1
#define W_DUE   2

#define KSHARED (plock + ptell + pquiet)
/* busy_lock.sql succeeds: K exclusive, and after an unconfirmed release of
 * B (needfree) also B free */
#ifdef FLAW_NO_FREE_CHECK
#define GRANT (KSHARED == 0)
#else
#define GRANT (KSHARED == 0 && (!needfree || !BHELD))
#endif
#define OPEN    (KSHARED + etell + equiet)
#ifndef FLAW_EARLY_READ
#define etell  0
#define equiet 0
#endif

#define ALLCLAIMED (nclaimed == NMSG)
#ifdef MARK_WATCH
#define QUIET(d) (dead[d] || (st[d] == S_IDLE && !wake[d] && !pend[d] && !pendm[d] && watch[d] == W_NONE))
#else
#define QUIET(d) (dead[d] || (st[d] == S_IDLE && !wake[d] && !pend[d] && watch[d] == W_NONE))
#endif
#define QUIESCENT (ncommitted == NMSG && QUIET(0) && QUIET(1))

ltl safe { [] (QUIESCENT -> ALLCLAIMED) }
ltl liveness { <> ALLCLAIMED }

/* --- helpers, each used inside an atomic step -------------------------- */

/* A new mark's notification ('b:'), to the other dispatcher.  With
 * MARK_WATCH it is told apart from a message's and makes the receiving
 * lane's watch timer due: the lane looks at once, and settles if the mark
 * is gone by then. */
#ifdef MARK_WATCH
#ifdef SYNC_NOTIFY
inline notify_mark() {
	if :: !dead[1-d] -> wake[1-d] = true; watch[1-d] = W_DUE :: else -> skip fi
}
#else
inline notify_mark() {
	if :: !dead[1-d] -> pendm[1-d] = true :: else -> skip fi
}
#endif
#else
/* a plain wake-up of the other lane (its owner ignores its own: the
 * dispatcher drops a 'b:' notification that names itself) */
#ifdef SYNC_NOTIFY
inline notify_mark() {
	if :: !dead[1-d] -> wake[1-d] = true :: else -> skip fi
}
#else
inline notify_mark() {
	if :: !dead[1-d] -> pend[1-d] = true :: else -> skip fi
}
#endif
#endif

/* A notification to every dispatcher still connected. */
#ifdef SYNC_NOTIFY
inline notify_all() {
	if :: !dead[0] -> wake[0] = true :: else -> skip fi;
	if :: !dead[1] -> wake[1] = true :: else -> skip fi
}
#else
inline notify_all() {
	if :: !dead[0] -> pend[0] = true :: else -> skip fi;
	if :: !dead[1] -> pend[1] = true :: else -> skip fi
}
#endif

/* Owner o's mark changed (its row was refreshed, deleted or expired, or its
 * hold of B ended): what the other lane's timer waits for is over or
 * superseded, so the timer may fire.  (After a refresh this lets it fire
 * early: a harmless over-approximation, its pass finds the refreshed mark
 * and re-arms.) */
#ifdef FLAW_LAST_PASS
inline mark_changed(o) {
	if :: watch[1-o] == W_ARMED -> watch[1-o] = W_DUE :: else -> skip fi;
	if :: pw[1-o] == W_ARMED -> pw[1-o] = W_DUE :: else -> skip fi
}
#else
inline mark_changed(o) {
	if :: watch[1-o] == W_ARMED -> watch[1-o] = W_DUE :: else -> skip fi
}
#endif

/* --- producers ---------------------------------------------------------- */

/* A producer transaction: INSERT; its statement trigger takes K shared
 * (pg_advisory_xact_lock_shared, held until the end of the transaction),
 * then tests B (pg_try_advisory_lock_shared, released at once) and calls
 * pg_notify if B was free; COMMIT.  Lock state is not MVCC: the test sees
 * the current holder under every isolation level.  Commit makes the
 * message visible, then sends the notification, then releases K
 * (PostgreSQL's CommitTransaction order).  Taking K shared never blocks in
 * the model: a dispatcher holds K exclusively only inside one atomic step.
 * The momentary shared hold of B is not a state of its own: its only
 * effect, making a dispatcher's try of B fail, is covered by tries that
 * fail at will.  One process runs all NMSG transactions, at most NPROD open
 * at once, interleaved in every possible order. */
proctype producers() {
	do
#ifndef FLAW_EARLY_READ
	:: atomic { pnew > 0 && OPEN < NPROD -> pnew--; plock++;       /* INSERT; lock K shared */
		EV("EV producer: BEGIN; INSERT; trigger takes K shared\n") }
	:: atomic {                                                     /* test B */
		plock > 0 -> plock--;
		if
		:: BHELD -> pquiet++;
			EV("EV producer: trigger tests B: held (d0 %d, d1 %d, dying backend %d): will NOT notify\n", held[0], held[1], gh)
		:: else -> ptell++;
			EV("EV producer: trigger tests B: free: will notify\n")
		fi
	   }
#else
	/* B tested first, then K taken */
	:: atomic {
		pnew > 0 && OPEN < NPROD -> pnew--;
		if
		:: BHELD -> equiet++;
			EV("EV producer: tests B BEFORE taking K: held: will NOT notify\n")
		:: else -> etell++;
			EV("EV producer: tests B BEFORE taking K: free: will notify\n")
		fi
	   }
	:: atomic { etell > 0 -> etell--; ptell++; EV("EV producer: INSERT; takes K shared\n") }
	:: atomic { equiet > 0 -> equiet--; pquiet++; EV("EV producer: INSERT; takes K shared\n") }
#endif
	:: atomic { ptell > 0 -> ptell--; vis++; ncommitted++; notify_all();  /* COMMIT */
		EV("EV producer: COMMIT + pg_notify; releases K (committed %d)\n", ncommitted) }
	:: atomic { pquiet > 0 -> pquiet--; vis++; ncommitted++;             /* COMMIT */
		EV("EV producer: COMMIT, no notification; releases K (committed %d)\n", ncommitted) }
	:: atomic { ncommitted == NMSG -> break }
	od
}

/* --- dispatchers -------------------------------------------------------- */

/* Lane d tries to take B exclusively (busy_hold.sql, on its lock session),
 * in a round trip of its own before a busy pass.  The try fails when
 * another session holds B, and may fail at any time (a producer's
 * momentary shared hold, or no try on this pass: lane.go tries when it
 * upserts the row, and on every busy pass after a refused try).  A try
 * that succeeds also notifies the other
 * dispatchers (the fix for FLAW_HOLD_SILENT).  got: the lane's lock holder
 * has B as held (or as lost, if its session has since been dropped). */
inline take_b() {
	atomic {
		if
		:: !BHELD ->
			held[d] = true; got = true;
			assert(!held[1-d] && !gh);   /* one holder at most */
#ifndef FLAW_HOLD_SILENT
			notify_mark();
#endif
			EV("EV d%d takes B\n", d)
#if NDROP > 0
		:: !BHELD && drops < NDROP ->
			/* the server granted B and sent the notification, then the
			 * session broke before the reply: an error, and a dying
			 * backend that holds B.  busylock must count B as lost. */
			gh = true; drops++;
#ifndef FLAW_HOLD_SILENT
			notify_mark();
#endif
#ifndef HOLD_ERR_FORGET
			got = true;
#endif
			EV("EV d%d's try of B errors (granted, then its session broke)\n", d)
#endif
		:: !held[d] -> EV("EV d%d's try of B fails (or no try)\n", d)
		:: else -> skip
		fi
	}
}

/* One claim pass of lane d: ONE transaction.  It claims up to CAP visible,
 * unclaimed messages (FOR UPDATE SKIP LOCKED), reads whether the other
 * dispatcher has a live row or another session holds B (the watch timer is
 * then set), and, when it filled its capacity (MARK_NEXT: when busy),
 * upserts d's own row, notifying the other dispatcher if the row is new (d
 * had no live row).  Phase 1 is the statement: it locks rows and reads.  Phase
 * 2 is the commit; a crash before it rolls the pass back.  Sets n
 * (claimed), filled, skipped (met ready rows locked by another claimer),
 * foreign (saw a live foreign mark). */
inline pass() {
	atomic {
		if
		:: vis >= CAP -> n = CAP
		:: else -> n = vis
		fi;
		vis = vis - n;
		lk[d] = n;
		skipped = (n < CAP && lk[1-d] > 0);
		foreign = live[1-d];
#ifndef FLAW_WATCH_ROW_ONLY
		/* next_due_queue.sql tests B unless the lane's holder has it as
		 * held: so not while d holds it, maybe not when d's session was
		 * dropped unnoticed; otherwise any session holding B (the other
		 * dispatcher, or a dying backend, d's own old one included) is
		 * a foreign mark */
		if
		:: got && held[d] -> skip
		:: got && !held[d] -> skip       /* drop not noticed yet */
		:: !held[d] -> if :: held[1-d] || gh -> foreign = true :: else -> skip fi
		fi;
#endif
#ifdef FLAW_LAST_PASS
		if :: foreign -> pw[d] = W_ARMED :: else -> pw[d] = W_NONE fi;
#else
		if :: foreign -> watch[d] = W_ARMED :: else -> skip fi;
#endif
		EV("EV d%d pass: locks %d row(s); skips rows another claim holds %d; sees a live foreign mark %d\n", d, n, skipped, foreign);
#ifdef FLAW_SKIP
		skipped = false;
#endif
#ifndef ATOMIC_PASS
	}
	atomic {
#endif
		filled = (n == CAP);
		lk[d] = 0;
		nclaimed = nclaimed + n;
		/* no message is claimed twice */
		assert(vis + lk[0] + lk[1] + nclaimed == ncommitted);
		if
#ifdef MARK_NEXT
		:: marking ->
#else
		:: filled ->
#endif
			EV("EV d%d pass commits: claimed %d (total %d); upserts own row (%d = new)\n", d, n, nclaimed, !live[d]);
#if !defined(NO_ROW_NOTIFY) && !defined(NO_ROW)
			if :: !live[d] -> notify_mark(); EV("EV d%d   new row: pg_notify to all\n", d) :: else -> skip fi;
#endif
#ifndef NO_ROW
			live[d] = true;
#endif
			mark_changed(d)
		:: else -> EV("EV d%d pass commits: claimed %d (total %d)\n", d, n, nclaimed)
		fi
	}
}

/* The lane goes to sleep. */
#ifdef FLAW_LAST_PASS
inline sleep() {
	atomic {
		if :: pw[d] != W_NONE -> watch[d] = pw[d] :: else -> skip fi;
		pw[d] = W_NONE;
		n = 0; filled = false; skipped = false; foreign = false; bytimer = false;
		st[d] = S_IDLE;
		EV("EV d%d sleeps (watch timer %d)\n", d, watch[d])
	}
}
#else
inline sleep() {
	atomic {
		n = 0; filled = false; skipped = false; foreign = false; bytimer = false;
		st[d] = S_IDLE;
		EV("EV d%d sleeps (watch timer %d)\n", d, watch[d])
	}
}
#endif

proctype dispatcher(byte d) {
	byte n;
	bool filled, skipped, foreign, bytimer;
	bool got;               /* the lock holder has B as held or lost */
	bool needfree;          /* lane.needFree: B's release was unconfirmed */
	byte lingers;           /* empty passes while busy, in a row */
#ifdef MARK_NEXT
	bool marking;           /* lane.busy: this pass upserts the row */
#endif
	{
		skip;
IDLE:
		sleep();
		assert(!held[d] && !got && !needfree);  /* it sleeps only with B released */
#ifndef NO_MARK_ASSERT
		assert(!live[d]);  /* ... and its own row deleted */
#endif
end_idle:
		if
		:: atomic { wake[d] -> wake[d] = false; st[d] = S_RUN; EV("EV d%d woken by a notification\n", d) }
		:: atomic { watch[d] == W_DUE -> watch[d] = W_NONE; st[d] = S_RUN; bytimer = true;
			EV("EV d%d watch timer fires\n", d) }
		fi;

WAKEPASS:	/* woken by a notification or by the watch timer */
		pass();
		if
		:: filled -> goto BUSY
#ifndef NO_STREAM
		:: n > 0 -> goto BUSY   /* a steady stream */
#endif
		:: !filled && (n > 0 || skipped) -> goto WAKEPASS
		:: else -> skip
		fi;
		if
		:: foreign -> goto IDLE          /* watch armed on that mark */
		:: else -> skip
		fi;
		if
		:: bytimer ->
#ifdef FLAW_TIMER_IDLE
			goto IDLE
#else
			goto LOCKWAIT   /* the watched mark is gone: settle (b)-(c) */
#endif
		:: else -> skip
		fi;
#if defined(FLAW_WAKE_IDLE) || defined(MARK_WATCH)
		goto IDLE;
#else
		goto LOCKWAIT;  /* fix: a wake-up that finds nothing settles too */
#endif

BUSY:		/* marked: tries B, then passes while they claim something */
#ifdef MARK_NEXT
		marking = true;
#endif
		take_b();
		pass();
		if
		:: n > 0 || skipped -> lingers = 0; goto BUSY
#ifndef NO_STREAM
		:: n == 0 && !skipped && lingers < LINGER -> lingers++; goto BUSY   /* polls on */
		:: n == 0 && !skipped -> skip
#else
		:: else -> skip
#endif
		fi;
		lingers = 0;
		/* SETTLE (a0): release B (busy_release.sql).  Confirmed if the
		 * session still holds it; unconfirmed if the session was dropped
		 * (its dying backend may still hold B): then the settle must
		 * also see B free.  needfree stays set until a settle gets K. */
		atomic {
			if
			:: held[d] -> held[d] = false; mark_changed(d);
				EV("EV d%d settle: releases B (confirmed)\n", d)
			:: !held[d] && got -> needfree = true;
				EV("EV d%d settle: releases B: unconfirmed (its session was dropped)\n", d)
			:: else -> EV("EV d%d settle: never held B\n", d)
			fi;
			got = false
		}
		/* SETTLE (a): delete the own row */
		atomic {
			if :: live[d] -> live[d] = false; mark_changed(d) :: else -> skip fi;
#ifdef MARK_NEXT
			marking = false;
#endif
			EV("EV d%d settle: deletes own row\n", d)
		}

LOCKWAIT:	/* SETTLE (b): busy_lock.sql until it succeeds: K exclusive,
		 * and, after an unconfirmed release, B free too, in one
		 * statement.  A failed try changes nothing, so it is not a step
		 * of its own: the lane just waits for the condition, and, if
		 * woken meanwhile, it may run a pass first. */
#ifndef FLAW_NO_LOCKWAIT
		do
		:: atomic { GRANT ->
#ifdef FLAW_NO_FREE_CHECK
			EV("EV d%d settle: try K exclusive (B not checked, unconfirmed release %d): granted\n", d, needfree);
#else
			EV("EV d%d settle: try K exclusive (and B free, after an unconfirmed release %d): granted\n", d, needfree);
#endif
			needfree = false; break }
		:: atomic { !(GRANT) && wake[d] -> wake[d] = false;
			EV("EV d%d settle: try fails; woken meanwhile: pass\n", d) };
			pass();
#ifndef FLAW_SETTLE_MARK
			if
			:: filled -> goto BUSY
#ifndef NO_STREAM
			:: n > 0 -> goto BUSY
#endif
			:: !filled -> skip
			fi
#endif
		od;
#else
		needfree = false;
#endif

FINAL:		/* SETTLE (c): the pass after the lock was granted */
		pass();
		if
		:: filled -> goto BUSY
#ifndef NO_STREAM
		:: n > 0 -> goto BUSY
#endif
		:: !filled && (n > 0 || skipped) -> goto FINAL
		:: else -> goto IDLE
		fi
	} unless { dead[d] }
}

/* Row expiry: a live row may expire at any moment, whether its owner died
 * or is alive but slow (its lease ran out before it refreshed it). */
proctype clock(byte o) {
end_clock:
	do
	:: atomic {
		live[o] -> live[o] = false;
		EV("EV d%d's row expires\n", o);
		mark_changed(o)
	   }
	od
}

/* The server side of the lock sessions.  While dispatcher d is alive, the
 * server may end its lock session at any moment (idle_session_timeout, a
 * broken connection) without d knowing: B is then held by the dying
 * backend (gh) until it notices, at some later moment.  A crash or a stop
 * leaves such a backend too (fail()). */
proctype locksrv() {
end_locksrv:
	do
#if NDROP > 0
	:: atomic { held[0] && drops < NDROP -> held[0] = false; gh = true; drops++;
		EV("EV d0's lock session is dropped; its backend still holds B\n") }
	:: atomic { held[1] && drops < NDROP -> held[1] = false; gh = true; drops++;
		EV("EV d1's lock session is dropped; its backend still holds B\n") }
#endif
	:: atomic { gh -> gh = false; mark_changed(0); mark_changed(1);
		EV("EV the dying backend exits: B is free\n") }
	od
}

/* Notification delivery: the listener hands the notification to the lane
 * some time after the commit that sent it. */
proctype postman(byte d) {
end_post:
	do
	:: atomic { pend[d] -> pend[d] = false; if :: !dead[d] -> wake[d] = true :: else -> skip fi;
		EV("EV notification reaches d%d\n", d) }
#ifdef MARK_WATCH
	:: atomic { pendm[d] -> pendm[d] = false;
		if :: !dead[d] -> wake[d] = true; watch[d] = W_DUE :: else -> skip fi;
		EV("EV new-mark notification reaches d%d: watch due\n", d) }
#endif
	od
}

/* At most one dispatcher failure, at any moment: a crash (its row stays
 * until the lease ends; its uncommitted pass rolls back) or a clean stop
 * (a stop, Run's context cancelled: busy_clear.sql deletes its rows; no
 * lock wait).  Either
 * way its lock session ends, and the backend may hold B a while longer. */
inline fail(f) {
	dead[f] = true;
	wake[f] = false; pend[f] = false; watch[f] = W_NONE;
#ifdef MARK_WATCH
	pendm[f] = false;
#endif
	vis = vis + lk[f]; lk[f] = 0;
	if :: held[f] -> held[f] = false; gh = true :: else -> skip fi;
	if
#ifndef STOP_ONLY
	:: EV("EV d%d CRASHES (its row, live %d, stays; B held %d)\n", f, live[f], gh)   /* crash */
#endif
#ifndef CRASH_ONLY
	:: live[f] -> live[f] = false; mark_changed(f);                            /* stop */
		EV("EV d%d STOPS: deletes its row, closes its lock session (B held %d)\n", f, gh)
	:: !live[f] -> EV("EV d%d STOPS (no live row), closes its lock session (B held %d)\n", f, gh)
#endif
	fi
}

proctype failure() {
	if
	:: atomic { fail(0) }
	:: atomic { fail(1) }
	:: skip           /* under weak fairness, "no failure" must be possible */
	fi
}

init {
	atomic {
		run dispatcher(0);
		run dispatcher(1);
#ifndef NO_EXPIRY
		run clock(0);
		run clock(1);
#endif
#ifndef SYNC_NOTIFY
		run postman(0);
		run postman(1);
#endif
		run locksrv();
		run producers();
#ifndef NO_FAILURE
		run failure();
#endif
	}
}
