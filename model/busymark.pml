/*
 * busymark.pml -- Promela model of Bellhop's busy-mark protocol (issue 7):
 * producers skip pg_notify while a dispatcher holds a live busy mark on the
 * queue, and no wake-up may be lost.  README.md beside this file maps the
 * model to the SQL/Go code and gives the abstractions and the results.
 *
 * One queue; NMSG producer transactions of one message each, at most NPROD
 * of them open at once (NPROD concurrent producers); ND = 2 dispatchers
 * that claim up to CAP messages per pass; at most one dispatcher failure
 * (a crash, or a clean stop); busy marks that may expire at any moment;
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
 * locked and visible counts always add up to the committed ones), a lane
 * only sleeps after deleting its own mark.
 *
 * Compile-time switches.  By default the model is the protocol as
 * specified plus the fixes the model showed necessary; each FLAW_* switch
 * restores one deviation: a deliberately broken protocol, or the
 * specification's literal wording where the model showed that it loses
 * wake-ups (README.md, "Findings"):
 *   FLAW_NO_LOCKWAIT    settle skips step (b): no exclusive try of K
 *   FLAW_EARLY_READ     producer reads the marks before taking K shared (as
 *                       does a REPEATABLE READ transaction, whose snapshot
 *                       predates the lock)
 *   FLAW_STALE_NOW      producer judges leases by its transaction's start
 *                       time, now(), instead of clock_timestamp()
 *   FLAW_NO_NEW_NOTIFY  a newly inserted mark does not wake the others
 *   FLAW_TIMER_IDLE     a watch timer that finds no live mark sleeps again
 *                       without settling
 *   FLAW_SETTLE_MARK    (spec) a pass run while settle step (b) waits, that
 *                       fills its capacity, sets the mark and stays in SETTLE
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
 *                the lane busy, and the mark is upserted by every LATER pass
 *                while busy (the first one included), not by the filling one
 *   (default)    a steady stream: any pass that claims something may make
 *                the lane busy, not only one that fills its slots (lane.go
 *                decides by time, BusyWindow; the model by free choice), and
 *                a busy lane may make up to LINGER empty passes before it
 *                settles (lane.go polls until the queue has been empty for
 *                a window).  NO_STREAM: only filling passes mark, and the
 *                first empty busy pass settles
 *   MARK_WATCH   the cheaper form of the FLAW_WAKE_IDLE fix: a new mark's
 *                notification is told apart from a message's and makes the
 *                receiving lane's watch timer due (lane.watching = true); a
 *                plain wake-up that finds nothing then sleeps at once
 * Model switches:
 *   ATOMIC_PASS  a pass is one indivisible step (no mid-pass crash, no
 *                skipped rows)
 *   SYNC_NOTIFY  a notification sets the wake flags at commit
 *   NO_FAILURE   no dispatcher crashes or stops
 *   CRASH_ONLY, STOP_ONLY   the failure can only be a crash, or a clean stop
 *   NO_EXPIRY    marks never expire (they are only deleted)
 *   NMSG, NPROD, CAP, LINGER  sizes (defaults 3, 2, 1, 1)
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
#define ND 2            /* dispatchers 0 and 1; d's other is 1-d */

/* Messages of the one queue.  They are interchangeable for wake-ups, so the
 * model counts them instead of naming them. */
byte vis;               /* committed, unclaimed, not locked by a claim */
byte lk[ND];            /* locked by dispatcher d's uncommitted claim pass */
byte nclaimed;          /* claimed (claim committed) */
byte ncommitted;        /* committed by producers */

/* Producer transactions, counted by step (interchangeable too). */
byte pnew = NMSG;       /* not begun */
byte plock;             /* INSERTed, hold K shared, marks not read yet */
byte ptell;             /* hold K shared, read: no live mark, will notify */
byte pquiet;            /* hold K shared, read: a live mark, will not notify */
#ifdef FLAW_EARLY_READ
byte etell, equiet;     /* read the marks (no live one / a live one), no lock yet */
#endif

bool live[ND];          /* queue_busy: owner d has a LIVE mark */
#ifdef FLAW_STALE_NOW
bool xrow[ND];          /* queue_busy: owner d has a row whose lease ended */
#endif

bool pend[ND];          /* a notification for lane d is on its way */
#ifdef MARK_WATCH
bool pendm[ND];         /* a new-mark notification for lane d is on its way */
#endif
bool wake[ND];          /* lane d's capacity-1 wake channel */
byte watch[ND];         /* lane d's watch timer on the other owner's lease */
#ifdef FLAW_LAST_PASS
byte pw[ND];            /* the watch the last pass would arm (spec, literal) */
#endif
byte st[ND];            /* S_IDLE while lane d sleeps */
bool dead[ND];          /* dispatcher d crashed or stopped */

#define S_RUN  0
#define S_IDLE 1
/* watch timer: none; armed (the watched lease is not over); due (may fire) */
#define W_NONE  0
#define W_ARMED 1
#define W_DUE   2

#define KSHARED (plock + ptell + pquiet)
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

/* A new mark's notification.  With MARK_WATCH it is told apart from a
 * message's (its own payload) and makes the receiving lane's watch timer
 * due: the lane looks at once, and settles if the mark is gone by then. */
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
#define notify_mark() notify_all()
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

/* Owner o's mark changed (refreshed, deleted or expired): the lease that the
 * other lane's timer waits for is over or superseded, so the timer may fire.
 * (After a refresh this lets it fire early: a harmless over-approximation,
 * its pass finds the refreshed mark and re-arms.) */
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

#ifdef FLAW_STALE_NOW
/* With now() = the transaction's start, a row whose lease ended after the
 * transaction began still looks live.  A transaction may begin at any
 * earlier moment, so any expired row may look live. */
#define SEEN(o) (live[o] || (xrow[o] && seen_x[o]))
#define ROWGONE(o) xrow[o] = false
#else
#define SEEN(o) live[o]
#define ROWGONE(o) skip
#endif

/* --- producers ---------------------------------------------------------- */

/* A producer transaction: INSERT; its statement trigger takes K shared
 * (pg_advisory_xact_lock_shared, held until the end of the transaction),
 * then reads queue_busy and calls pg_notify if no mark is live; COMMIT.
 * Commit makes the message visible, then sends the notification, then
 * releases K (PostgreSQL's CommitTransaction order).  Taking K shared
 * never blocks in the model: a dispatcher holds K exclusively only inside
 * one atomic step.  One process runs all NMSG transactions, at most NPROD
 * open at once, interleaved in every possible order. */
proctype producers() {
#ifdef FLAW_STALE_NOW
	bool seen_x[ND];
#endif
	do
#ifndef FLAW_EARLY_READ
	:: atomic { pnew > 0 && OPEN < NPROD -> pnew--; plock++;       /* INSERT; lock K shared */
		EV("EV producer: BEGIN; INSERT; trigger takes K shared\n") }
	:: atomic {                                                     /* read the marks */
		plock > 0 ->
#ifdef FLAW_STALE_NOW
		if :: seen_x[0] = true :: seen_x[0] = false fi;
		if :: seen_x[1] = true :: seen_x[1] = false fi;
#endif
		plock--;
		if
		:: SEEN(0) || SEEN(1) -> pquiet++;
			EV("EV producer: trigger reads marks: a live mark (d0 %d, d1 %d): will NOT notify\n", SEEN(0), SEEN(1))
		:: else -> ptell++;
			EV("EV producer: trigger reads marks: none live: will notify\n")
		fi
#ifdef FLAW_STALE_NOW
		; seen_x[0] = false; seen_x[1] = false
#endif
	   }
#else
	/* marks read first (a snapshot older than the lock), then the lock */
	:: atomic {
		pnew > 0 && OPEN < NPROD -> pnew--;
		if
		:: live[0] || live[1] -> equiet++;
			EV("EV producer: reads marks BEFORE the lock: a live mark: will NOT notify\n")
		:: else -> etell++;
			EV("EV producer: reads marks BEFORE the lock: none live: will notify\n")
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

/* One claim pass of lane d: ONE transaction.  It claims up to CAP visible,
 * unclaimed messages (FOR UPDATE SKIP LOCKED), reads whether another owner
 * has a live mark (the watch timer is then set for that mark's
 * lease_until), and, when it filled its capacity, upserts d's own mark,
 * notifying every dispatcher if the mark is new (d had no live mark).
 * Phase 1 is the statement: it locks rows and reads.  Phase 2 is the
 * commit; a crash before it rolls the pass back.  Sets n (claimed), filled,
 * skipped (met ready rows locked by another claimer), foreign (saw a live
 * mark of the other owner). */
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
			EV("EV d%d pass commits: claimed %d (total %d); upserts own mark (%d = new)\n", d, n, nclaimed, !live[d]);
#ifndef FLAW_NO_NEW_NOTIFY
			if :: !live[d] -> notify_mark(); EV("EV d%d   new mark: pg_notify to all\n", d) :: else -> skip fi;
#endif
			ROWGONE(d);
			live[d] = true;
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
	byte lingers;           /* empty passes while busy, in a row */
#ifdef MARK_NEXT
	bool marking;           /* lane.busy: this pass upserts the mark */
#endif
	{
		skip;
IDLE:
		sleep();
#ifndef NO_MARK_ASSERT
		assert(!live[d]);  /* it sleeps only with its own mark deleted */
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

BUSY:		/* has its mark; passes while they claim something */
#ifdef MARK_NEXT
		marking = true;
#endif
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
		/* SETTLE (a): delete the own mark */
		atomic {
			if :: live[d] -> live[d] = false; mark_changed(d) :: else -> skip fi;
			ROWGONE(d);
#ifdef MARK_NEXT
			marking = false;
#endif
			EV("EV d%d settle: deletes own mark\n", d)
		}

LOCKWAIT:	/* SETTLE (b): pg_try_advisory_xact_lock(K) until it succeeds.  A
		 * failed try changes nothing, so it is not a step of its own:
		 * the lane just waits for KSHARED == 0, and, if woken
		 * meanwhile, it may run a pass first. */
#ifndef FLAW_NO_LOCKWAIT
		do
		:: atomic { KSHARED == 0 -> EV("EV d%d settle: try K exclusive: granted\n", d); break }
		:: atomic { KSHARED > 0 && wake[d] -> wake[d] = false;
			EV("EV d%d settle: try K exclusive fails; woken meanwhile: pass\n", d) };
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

/* Lease expiry: a live mark may expire at any moment, whether its owner
 * died or is alive but slow (its lease ran out before it refreshed it). */
proctype clock(byte o) {
end_clock:
	do
	:: atomic {
		live[o] -> live[o] = false;
		EV("EV d%d's mark expires\n", o);
#ifdef FLAW_STALE_NOW
		xrow[o] = true;
#endif
		mark_changed(o)
	   }
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

/* At most one dispatcher failure, at any moment: a crash (its mark stays
 * until the lease ends; its uncommitted pass rolls back) or a clean stop
 * (Dispatcher.Stop: busy_clear.sql deletes its marks; no lock wait). */
inline fail(f) {
	dead[f] = true;
	wake[f] = false; pend[f] = false; watch[f] = W_NONE;
#ifdef MARK_WATCH
	pendm[f] = false;
#endif
	vis = vis + lk[f]; lk[f] = 0;
	if
#ifndef STOP_ONLY
	:: EV("EV d%d CRASHES (its mark, live %d, stays)\n", f, live[f])   /* crash */
#endif
#ifndef CRASH_ONLY
	:: live[f] -> live[f] = false; mark_changed(f); ROWGONE(f);            /* stop */
		EV("EV d%d STOPS: deletes its mark\n", f)
	:: !live[f] -> EV("EV d%d STOPS (no live mark)\n", f)
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
		run producers();
#ifndef NO_FAILURE
		run failure();
#endif
	}
}
