/*
 * offers.pml -- Promela model of leasing at INSERT: offers, the lease key,
 * lease notifications and their recovery (docs/lease-at-insert.md;
 * migrations 0044-0046 and 0055's owner key; offers.go, lane.go,
 * dispatcher.go, notify/).
 * OFFERS.md beside this file maps the model to the code and gives the
 * abstractions and the results.
 *
 * One queue; NMSG producer transactions of one message each, all open at
 * once; ND = 2 leasing dispatchers with one slot each (max in-flight 1),
 * each making at most NOFF offers; listener connections that the server
 * may drop (NDROP); leases that may run out (NEXP for a live holder); at
 * most one dispatcher failure (a crash or a clean stop).
 *
 * Properties:
 *   safe      [] (QUIESCENT -> ALLDONE)   (pan -N safe, compiled -DSAFETY)
 *             once every producer has committed and every dispatcher is
 *             listening with nothing left to do (no wake-up, handler,
 *             waiting lease, notification on its way or recovery under
 *             way), every message has been handled and acked.  Run with
 *             NO_POLL and NO_EXPIRY: the notifications and the recovery
 *             after a reconnect must deliver everything on their own.
 *   progress  (pan -l, compiled -DNP)  with the fallback poll, the
 *             reclaimer and leases that run out, every message is
 *             eventually acked: the idler, which polls for ever once
 *             nothing else can run, passes its progress label only when
 *             every message is acked, so a message that nothing recovers
 *             shows as a non-progress cycle.  (Weak fairness, pan -a -f,
 *             did not finish: 14 processes.)
 * and in-line assertions, checked in every run:
 *   - a handler starts only under its message's current claim token, and
 *     never while another handler holds the same message under a lease
 *     that has not run out (never two consumers at once under a lease);
 *   - a token starts at most one handler, and leases at most one message.
 *
 * Compile-time switches.  By default the model is the code as built (with
 * the fix of finding A, OFFERS.md); each FLAW_* switch breaks one rule, to
 * show that the model tells (check.sh runs each one and expects it caught):
 *   FLAW_LATE_START     a leased message whose lease has run out by the time
 *                       a slot is free starts anyway (lane.deliver releases
 *                       it unstarted)
 *   FLAW_TOKEN_TWICE    useToken does not take the token out of the book: a
 *                       lease heard of by notification and found by recovery
 *                       is delivered twice
 *   FLAW_NO_RECOVERY    no search by token after a reconnect (control, on a
 *                       reload with wakeAll)
 *   FLAW_FORGET_GONE    afterPoll forgets an offer that the poll found gone,
 *                       instead of keeping its token until its lease could
 *                       have run out: the poll ran while the offer's INSERT
 *                       was on its way, and a lease made under the offer
 *                       once it is in the table is ignored
 *   FLAW_SHARE_OFFER    the producer's offer lookup does not skip locked
 *                       offers: two producers take one offer
 *   FLAW_SHORT_FORGET   (the code before finding A) a token whose offer's
 *                       INSERT failed is forgotten after the offer's TTL
 *                       only, while a lease made under it may still hold
 *   FLAW_DROP_SKIP      (before offer_drop_all.sql) a clean stop's final
 *                       drop skips an offer a producer holds locked: the
 *                       producer commits a lease after the book is closed
 *   FLAW_NO_OWNER_KEY   (before migration 0055) producers take any live
 *                       offer, whether its owner's listener holds its key
 *                       or not: a crashed dispatcher's offer is used
 * Model switches:
 *   NO_POLL      no fallback poll (and a reclaimer that only knows of the
 *                leases its own dispatcher heard of)
 *   NO_EXPIRY    leases never run out
 *   NO_FAILURE   no dispatcher crashes or stops
 *   CRASH_ONLY, STOP_ONLY   the failure can only be a crash, or a clean stop
 *   NMSG, NOFF, NDROP, NEXP, NPOLL   sizes (defaults 2, 2, 1, 1, 1; NPOLL
 *                counts the polls amid other work of each dispatcher)
 *   NLOSE        'l:' notifications lost while the listener is connected
 *                (default 0): a notification the listener could not parse
 *                (notify.ParseLease), which only the poll brings back
 */

#ifdef NO_EV
#define EV(...) skip
#else
#define EV(...) printf(__VA_ARGS__)
#endif

#ifndef NMSG
#define NMSG 2          /* producer transactions, one message each */
#endif
#ifndef NOFF
#define NOFF 2          /* offers each dispatcher may make */
#endif
#ifndef NDROP
#define NDROP 1         /* listener connections the server drops */
#endif
#ifndef NPOLL
#define NPOLL 1         /* polls that may come amid other work */
#endif
#ifndef NLOSE
#define NLOSE 0         /* 'l:' notifications lost while connected */
#endif
#ifndef NEXP
#define NEXP 1          /* leases of live, listening holders that run out */
#endif
#define ND 2            /* dispatchers 0 and 1 */
#define NTOK 16         /* token ids 1..15; 0 is NULL */

/* A message's life. */
#define M_NEW    0      /* not inserted yet */
#define M_INS    1      /* inserted, not committed; the trigger has not run */
#define M_LOCK   2      /* its trigger locked an offer; committing */
#define M_COMMIT 3      /* committed */
#define M_DONE   4      /* acked: deleted */
byte mst[NMSG];
byte tok[NMSG];         /* claim_token; 0 = NULL */
byte plk[NMSG];         /* the offer its trigger locked */

/* Tokens: claim tokens and offer tokens, one counter. */
byte ntok = 1;          /* next free token id */
byte town[NTOK];        /* the dispatcher that made it */
byte tmsg[NTOK];        /* message + 1 leased or claimed under it */
bool texp[NTOK];        /* the lease under it has run out */
bool used[NTOK];        /* it started a handler */
bool obs[NTOK];         /* its dispatcher knows a lease under it exists */

/* bellhop_offers rows */
#define O_NONE   0
#define O_FREE   1
#define O_LOCKED 2      /* a producer's lease function holds it FOR UPDATE */
byte orow[NTOK];

/* The dispatcher's book (offerBook.byToken) */
#define B_NONE    0
#define B_LIVE    1     /* on offer as far as it knows */
#define B_UNHEARD 2     /* no longer on offer, not heard of: kept until forget */
byte bk[NTOK];
bool shortf[NTOK];       /* its offer's INSERT failed: forget after the TTL */
bool lnote[NTOK];       /* its 'l:' notification is on its way */
bool pendl[NTOK];       /* leased and heard of, waiting for a slot */

/* Dispatchers */
#define P_RUN  0
#define P_STOP 1        /* stopping: lanes and listener stopped */
#define P_GONE 2        /* stopped */
#define P_DEAD 3        /* crashed */
byte ph[ND];
#define L_UP    0       /* LISTENing, lease key held */
#define L_DOWN  1       /* no connection */
#define L_KEYED 2       /* new connection: key held, not LISTENing yet */
byte lst[ND];
bool key[ND];           /* its listener's session holds the lease key */
bool wq[ND];            /* the lane has a claim wake-up */
bool bl[ND];            /* backlog: a wake-up came while the slot was full */
byte slot[ND];          /* message + 1 its handler runs, 0 = slot free */
byte rtok[ND];          /* the token the handler runs under */
bool offered[ND];       /* lane.offered */
byte mk[ND];            /* token whose offer INSERT is on its way */
byte noff[ND];          /* offers made */
bool rc[ND];            /* listener reconnected: wake and recover */
int rset[ND];           /* tokens to look up by offer_recover.sql */
int fnd[ND];            /* tokens the lookup found, to deliver */
int gone[ND];           /* tokens the poll asked for and did not get back */
byte drops;
byte npoll[ND];          /* polls amid other work, per dispatcher */
byte nlose;
byte nexp;

#define LIVEPH(d) (ph[d] == P_RUN || ph[d] == P_STOP)
#define BIT(t) (1 << (t))

#if NMSG == 1
#define PRODUCED (mst[0] >= M_COMMIT)
#define ALLDONE  (mst[0] == M_DONE)
#elif NMSG == 2
#define PRODUCED (mst[0] >= M_COMMIT && mst[1] >= M_COMMIT)
#define ALLDONE  (mst[0] == M_DONE && mst[1] == M_DONE)
#else
#define PRODUCED (mst[0] >= M_COMMIT && mst[1] >= M_COMMIT && mst[2] >= M_COMMIT)
#define ALLDONE  (mst[0] == M_DONE && mst[1] == M_DONE && mst[2] == M_DONE)
#endif
/* quiet(d): d has nothing left to do; hasnote/haspend are kept up to date
 * by the steps that change lnote and pendl */
byte nnote[ND];         /* 'l:' notifications on their way to d */
byte npend[ND];         /* leases waiting for d's slot */
#define QUIET(d) (ph[d] == P_GONE || ph[d] == P_DEAD || \
	(ph[d] == P_RUN && lst[d] == L_UP && !wq[d] && slot[d] == 0 && npend[d] == 0 && \
	 nnote[d] == 0 && rset[d] == 0 && fnd[d] == 0 && gone[d] == 0 && !rc[d] && mk[d] == 0))
#define QUIESCENT (PRODUCED && QUIET(0) && QUIET(1))

/* Guards over the messages (NMSG is at most 3). */
#if NMSG == 1
#define ANYM(P) (P(0))
#elif NMSG == 2
#define ANYM(P) (P(0) || P(1))
#else
#define ANYM(P) (P(0) || P(1) || P(2))
#endif
/* reclaim.sql: a lease that ran out.  Without the poll, a dispatcher's
 * reclaimer learns only of the leases it heard of. */
#ifdef NO_POLL
#define RECLAIMABLE(m) (mst[m] == M_COMMIT && tok[m] != 0 && texp[tok[m]] && town[tok[m]] == d && obs[tok[m]])
#else
#define RECLAIMABLE(m) (mst[m] == M_COMMIT && tok[m] != 0 && texp[tok[m]])
#endif
#define EXPIRABLE(m) (mst[m] == M_COMMIT && tok[m] != 0 && !texp[tok[m]] && \
	(ph[town[tok[m]]] == P_DEAD || ph[town[tok[m]]] == P_GONE || nexp < NEXP))
/* offerTokens may forget an unheard token once its time is up: its offer
 * (forget is set TTL + VT after it left the offer) has expired, and so has
 * any lease made under it.  FLAW_SHORT_FORGET: a token whose offer's
 * INSERT failed was forgotten after the TTL alone. */
#ifdef FLAW_SHORT_FORGET
#define FORGETTABLE(t) (orow[t] != O_LOCKED && mk[town[t]] != t && (shortf[t] || tmsg[t] == 0 || texp[t] || tok[tmsg[t] - 1] != t))
#else
#define FORGETTABLE(t) (orow[t] != O_LOCKED && mk[town[t]] != t && (tmsg[t] == 0 || texp[t] || tok[tmsg[t] - 1] != t))
#endif

ltl safe { [] (QUIESCENT -> ALLDONE) }

/* --- helpers, each used inside an atomic step ---------------------------- */

/* 'q:' on bellhop: every dispatcher whose listener is LISTENing hears it
 * (the lane's wake-up; the delay of the notification itself is the busy
 * model's business) */
inline notify_q() {
	if :: ph[0] == P_RUN && lst[0] == L_UP -> wq[0] = true :: else -> skip fi;
	if :: ph[1] == P_RUN && lst[1] == L_UP -> wq[1] = true :: else -> skip fi
}

/* The listener's connection ends: notifications on their way are lost and
 * the session's lease key goes with it. */
inline drop_listener(d) {
	lst[d] = L_DOWN; key[d] = false;
	i = 1;
	do
	:: i < NTOK -> if :: lnote[i] && town[i] == d -> lnote[i] = false :: else -> skip fi; i++
	:: else -> break
	od;
	nnote[d] = 0
}

/* release.sql for the message leased under t: fenced by the token; wakes
 * the queue */
inline release(t) {
	if
	:: tok[tmsg[t] - 1] == t && mst[tmsg[t] - 1] == M_COMMIT ->
		tok[tmsg[t] - 1] = 0; notify_q();
		EV("EV   m%d released (token %d)\n", tmsg[t] - 1, t)
	:: else -> EV("EV   release of m%d under token %d matches nothing\n", tmsg[t] - 1, t)
	fi
}

/* useToken: takes t out of d's book once; ok tells whether it was there */
inline use_token(t) {
	if
	:: bk[t] != B_NONE ->
		if :: bk[t] == B_LIVE -> offered[d] = false :: else -> skip fi;
#ifndef FLAW_TOKEN_TWICE
		bk[t] = B_NONE;
#endif
		ok = true
	:: else -> ok = false
	fi
}

/* lane.leased: waits for the slot, or is released if the lane stopped */
inline leased(t) {
	obs[t] = true;
	if
	:: ph[d] == P_RUN -> pendl[t] = true; npend[d]++
	:: else -> release(t)
	fi
}

/* A handler starts for message m under token t. */
inline start(m, t) {
	assert(tok[m] == t && mst[m] == M_COMMIT);      /* its lease is current */
	assert(!used[t]);                                /* a token starts one handler */
	used[t] = true;
	/* never two consumers at once while a lease holds */
	assert(slot[1-d] != m + 1 || texp[rtok[1-d]]);
	slot[d] = m + 1; rtok[d] = t
}

#ifndef NO_POLL
/* poll.sql for dispatcher d, with offerTokens before it: extends d's
 * offers and returns those still in the table, a locked one included (the
 * extension skips it, but it is in the statement's snapshot: its producer
 * may roll back), so only an offer no longer in the table counts as gone;
 * forgets unheard tokens whose time is up, looks up the others, deletes
 * d's unheard offers and those of dispatchers long gone; and pokes the
 * lane.  The poll's other work (the heartbeat, the next lease expiry for
 * the reclaimer) is the reclaim step's guard. */
inline poll(d) {
	t = 1;
	do
	:: t < NTOK ->
		if
		:: town[t] == d && bk[t] == B_LIVE ->     /* offers: still in the table? */
			if :: orow[t] == O_NONE -> gone[d] = gone[d] | BIT(t) :: else -> skip fi
		:: town[t] == d && bk[t] == B_UNHEARD ->
			if
			:: FORGETTABLE(t) ->          /* offerTokens: its time is up */
				/* its offer, if still in the table, has expired */
				bk[t] = B_NONE; orow[t] = O_NONE;
				EV("EV d%d forgets token %d: its time is up\n", d, t)
			:: true ->                    /* recoverLeases(unheard) */
				rset[d] = rset[d] | BIT(t);
				if                        /* forgotten: ours, 5 s old */
				:: orow[t] == O_FREE -> orow[t] = O_NONE
				:: true
				fi
			fi
		:: town[t] != d && orow[t] == O_FREE && (ph[town[t]] == P_DEAD || ph[town[t]] == P_GONE) ->
			if :: orow[t] = O_NONE :: skip fi     /* gone for an hour */
		:: else -> skip
		fi; t++
	:: else -> break
	od;
	wq[d] = true;                    /* the poll pokes every lane */
	EV("EV d%d polls: offers gone %x; looks up unheard %x\n", d, gone[d], rset[d]);
}

#endif

/* --- producers ----------------------------------------------------------- */

/* One producer transaction: INSERT, then COMMIT, at which the deferred
 * constraint trigger runs: it tests the lease key (taken exclusively and let
 * go at once: granted only if no listener holds it shared); if it is held,
 * bellhop_lease_message locks one live offer of the queue FOR UPDATE SKIP
 * LOCKED, leases the row under the offer's token, deletes the offer and
 * sends 'l:' on the offer's channel; otherwise, or with no offer, 'q:'.
 * "No offer" may also be chosen with offers present: an offer past its
 * expires_at, the key test racing another producer's, a payload too large
 * for a notification, a delayed message. */
proctype producer(byte m) {
	byte i, t;
	atomic { mst[m] = M_INS; EV("EV m%d: INSERT\n", m) }
	atomic {
		if
		:: key[0] || key[1] ->
			i = 1;
			do
			:: i >= ntok -> break
#ifndef FLAW_SHARE_OFFER
#ifndef FLAW_NO_OWNER_KEY
			:: i < ntok && orow[i] == O_FREE && key[town[i]] ->
#else
			:: i < ntok && orow[i] == O_FREE ->
#endif
#else
			:: i < ntok && orow[i] != O_NONE ->
#endif
				assert(ph[town[i]] != P_DEAD);  /* no lease to a crashed dispatcher's offer */
				plk[m] = i; orow[i] = O_LOCKED; mst[m] = M_LOCK; break
			:: i < ntok -> i++
			od;
			if
			:: plk[m] != 0 -> EV("EV m%d: COMMIT: key held; locks offer %d of d%d\n", m, plk[m], town[plk[m]])
			:: else -> EV("EV m%d: COMMIT: key held; takes no offer\n", m)
			fi
		:: else -> EV("EV m%d: COMMIT: nobody holds the key\n", m)
		fi;
		i = 0
	}
	atomic {
		t = plk[m];
		if
		:: t != 0 ->
			assert(tmsg[t] == 0);       /* a token leases one message */
			assert(ph[town[t]] != P_GONE);  /* no lease outlives a clean stop, its attempt spent */
			tok[m] = t; tmsg[t] = m + 1; orow[t] = O_NONE;
			if
			:: ph[town[t]] == P_RUN && lst[town[t]] == L_UP -> lnote[t] = true; nnote[town[t]]++
			:: else -> skip             /* nobody LISTENs on the channel */
			fi;
			EV("EV m%d: committed, leased under token %d; 'l:' to d%d (heard %d)\n", m, t, town[t], lnote[t])
		:: else ->
			notify_q();
			EV("EV m%d: committed; 'q:' (d0 hears %d, d1 hears %d)\n", m, wq[0], wq[1])
		fi;
		mst[m] = M_COMMIT; t = 0
	}
}

/* --- dispatchers --------------------------------------------------------- */

/* The queue lane of dispatcher d (lane.go, offers.go): claim passes on
 * wake-ups, leased messages started as the slot frees, offers. */
proctype lane(byte d) {
	byte t, m;
end_lane:
	do
	:: atomic {                          /* a claim pass (claim_queue.sql) */
		ph[d] == P_RUN && wq[d] && (npend[d] == 0 || slot[d] != 0) -> wq[d] = false;
		if
		:: slot[d] != 0 -> bl[d] = true; EV("EV d%d wake-up while its slot is busy (backlog)\n", d)
		:: else ->
			m = 0;
			do
			:: m < NMSG && mst[m] == M_COMMIT && tok[m] == 0 -> break
			:: m < NMSG && !(mst[m] == M_COMMIT && tok[m] == 0) -> m++
			:: m >= NMSG -> break
			od;
			if
			:: m < NMSG ->
				t = ntok; ntok++; assert(ntok < NTOK);
				town[t] = d; tmsg[t] = m + 1; tok[m] = t; obs[t] = true;
				start(m, t);
				EV("EV d%d claims m%d under token %d\n", d, m, t)
			:: else -> EV("EV d%d claim pass: nothing ready\n", d)
			fi
		fi;
		t = 0; m = 0
	   }
	:: atomic {                          /* startPending */
		ph[d] == P_RUN && slot[d] == 0 && npend[d] > 0 ->
		t = 1;
		do
		:: t < NTOK && pendl[t] && town[t] == d -> break
		:: t < NTOK && !(pendl[t] && town[t] == d) -> t++
		od;
		pendl[t] = false; npend[d]--;
		m = tmsg[t] - 1;
#ifndef FLAW_LATE_START
		if
		:: texp[t] -> EV("EV d%d: the lease of m%d (token %d) ran out while it waited\n", d, m, t);
			release(t)
		:: else ->
#endif
			start(m, t);
			EV("EV d%d starts leased m%d (token %d)\n", d, m, t)
#ifndef FLAW_LATE_START
		fi
#endif
		; t = 0; m = 0
	   }
	:: atomic {                          /* makeOffer: the token goes in the book */
		ph[d] == P_RUN && !offered[d] && slot[d] == 0 && npend[d] == 0 && mk[d] == 0 && noff[d] < NOFF ->
		t = ntok; ntok++; assert(ntok < NTOK);
		town[t] = d; bk[t] = B_LIVE; offered[d] = true; mk[d] = t; noff[d]++;
		EV("EV d%d offers token %d\n", d, t);
		t = 0; m = 0
	   }
	:: atomic {                          /* ... and offer_make.sql */
		mk[d] != 0 && ph[d] == P_RUN -> t = mk[d]; mk[d] = 0;
		if
		:: orow[t] = O_FREE; EV("EV d%d's offer %d is in the table\n", d, t)
		:: true ->                    /* an error: the offer may or may not exist */
			if :: bk[t] != B_NONE -> bk[t] = B_UNHEARD; shortf[t] = true :: else -> skip fi;
			offered[d] = false;
			if :: orow[t] = O_FREE :: skip fi;
			EV("EV d%d's offer %d errs (in the table: %d)\n", d, t, orow[t])
		fi;
		t = 0; m = 0
	   }
	od
}

/* Dispatcher d's handler: acks under its token (ack.sql, fenced) and
 * frees the slot; a backlog pokes the lane. */
proctype handler(byte d) {
	byte m;
end_handler:
	do
	:: atomic {
		slot[d] != 0 && LIVEPH(d) -> m = slot[d] - 1;
		if
		:: tok[m] == rtok[d] -> mst[m] = M_DONE; tok[m] = 0;
			EV("EV d%d acks m%d (token %d)\n", d, m, rtok[d])
		:: else -> EV("EV d%d's ack of m%d under stale token %d matches nothing\n", d, m, rtok[d])
		fi;
		slot[d] = 0; rtok[d] = 0;
		if :: bl[d] -> bl[d] = false; wq[d] = true :: else -> skip fi;
		m = 0
	   }
	od
}

/* Dispatcher d's listener (notify/): hands 'l:' notifications on
 * (Dispatcher.onLease); the server may end its connection; a new one takes
 * the lease key (holdLeaseKey, OnConnect), then LISTENs, then asks control
 * for a reload with wakeAll. */
proctype listener(byte d) {
	byte i, t;
	bool ok;
end_listener:
	do
	:: atomic {
		ph[d] == P_RUN && lst[d] == L_UP && nnote[d] > 0 ->
		t = 1;
		do
		:: t < NTOK && lnote[t] && town[t] == d -> break
		:: t < NTOK && !(lnote[t] && town[t] == d) -> t++
		od;
		assert(t < NTOK);
		lnote[t] = false; nnote[d]--;
		use_token(t);
		if
		:: ok -> EV("EV d%d hears the lease of m%d (token %d)\n", d, tmsg[t] - 1, t); leased(t)
		:: else -> EV("EV d%d ignores the lease of m%d: token %d not in its book\n", d, tmsg[t] - 1, t)
		fi;
		i = 0; t = 0; ok = false
	   }
#if NLOSE > 0
	:: atomic {                          /* an 'l:' lost while connected */
		ph[d] == P_RUN && lst[d] == L_UP && nnote[d] > 0 && nlose < NLOSE ->
		t = 1;
		do
		:: t < NTOK && lnote[t] && town[t] == d -> break
		:: t < NTOK && !(lnote[t] && town[t] == d) -> t++
		od;
		lnote[t] = false; nnote[d]--; nlose++;
		EV("EV d%d drops the lease of m%d (token %d) unread\n", d, tmsg[t] - 1, t);
		t = 0
	   }
#endif
	:: atomic {
		ph[d] == P_RUN && lst[d] == L_UP && drops < NDROP -> drops++;
		drop_listener(d);
		EV("EV d%d's listener connection is dropped (key let go)\n", d);
		i = 0; t = 0; ok = false
	   }
	:: atomic { ph[d] == P_RUN && lst[d] == L_DOWN -> lst[d] = L_KEYED; key[d] = true;
		EV("EV d%d's listener reconnects and takes the key\n", d) }
	:: atomic { ph[d] == P_RUN && lst[d] == L_KEYED -> lst[d] = L_UP; rc[d] = true;
		EV("EV d%d's listener LISTENs\n", d) }
	od
}

/* Dispatcher d's control goroutine and reclaimer: the recovery after a
 * reconnect, the fallback poll and what follows it, the reclaim of leases
 * that ran out. */
proctype control(byte d) {
	byte t, m;
	bool ok;
end_control:
	do
	:: atomic {                          /* reload with wakeAll */
		ph[d] == P_RUN && rc[d] -> rc[d] = false;
		wq[d] = true;                    /* wakeAfterConnect */
#ifndef FLAW_NO_RECOVERY
		t = 1;                           /* recoverLeases(live + unheard) */
		do
		:: t < NTOK -> if :: bk[t] != B_NONE && town[t] == d -> rset[d] = rset[d] | BIT(t) :: else -> skip fi; t++
		:: else -> break
		od;
#endif
		EV("EV d%d after the reconnect: wakes the lane, looks up tokens %x\n", d, rset[d]);
		t = 0; m = 0; ok = false
	   }
	:: atomic {                          /* offer_recover.sql */
		ph[d] == P_RUN && rset[d] != 0 ->
		t = 1;
		do
		:: t < NTOK ->
			if
			:: (rset[d] & BIT(t)) && tmsg[t] != 0 && tok[tmsg[t] - 1] == t && mst[tmsg[t] - 1] == M_COMMIT ->
				fnd[d] = fnd[d] | BIT(t)
			:: else -> skip
			fi; t++
		:: else -> break
		od;
		EV("EV d%d looks up tokens %x: finds %x\n", d, rset[d], fnd[d]);
		rset[d] = 0;
		t = 0; m = 0; ok = false
	   }
	:: atomic {                          /* ... and delivers what it found */
		ph[d] == P_RUN && fnd[d] != 0 ->
		t = 1;
		do
		:: t < NTOK ->
			if
			:: fnd[d] & BIT(t) -> use_token(t);
				if
				:: ok -> EV("EV d%d recovers m%d (token %d)\n", d, tmsg[t] - 1, t); leased(t)
				:: else -> skip
				fi
			:: else -> skip
			fi; t++
		:: else -> break
		od;
		fnd[d] = 0;
		t = 0; m = 0; ok = false
	   }
#ifndef NO_POLL
	:: atomic {                          /* a poll amid other work */
		ph[d] == P_RUN && !rc[d] && rset[d] == 0 && fnd[d] == 0 && gone[d] == 0 && npoll[d] < NPOLL ->
		npoll[d]++;
		poll(d);
		t = 0; m = 0; ok = false
	   }
	:: atomic {                          /* afterPoll */
		ph[d] == P_RUN && gone[d] != 0 ->
		t = 1;
		do
		:: t < NTOK ->
			if
			:: (gone[d] & BIT(t)) && bk[t] == B_LIVE ->
#ifndef FLAW_FORGET_GONE
				bk[t] = B_UNHEARD;
#else
				bk[t] = B_NONE;
#endif
				offered[d] = false;
				rset[d] = rset[d] | BIT(t)
			:: else -> skip
			fi; t++
		:: else -> break
		od;
		EV("EV d%d after the poll: tokens %x no longer on offer\n", d, gone[d]);
		gone[d] = 0;
		t = 0; m = 0; ok = false
	   }
#endif
	:: atomic {                          /* reclaim.sql */
		ph[d] == P_RUN && ANYM(RECLAIMABLE) ->
		m = 0;
		do
		:: RECLAIMABLE(m) -> break
		:: else -> m++
		od;
		EV("EV d%d reclaims m%d (token %d ran out)\n", d, m, tok[m]);
		tok[m] = 0; notify_q();
		t = 0; m = 0; ok = false
	   }
	od
}

/* Leases run out.  One held by a dispatcher that is gone, or that never
 * heard of it, runs out in time whatever happens; NEXP bounds how often a
 * lease of a live dispatcher that knows of it runs out (a slow handler, a
 * lease that waited long for a slot). */
/* The fallback poll that comes once everything else has settled
 * (timeout: no other step of the model can run), for ever: the progress
 * check (pan -l) finds a cycle of such polls, without the progress label,
 * when a message is left unacked that no poll recovers. */
#ifndef NO_POLL
proctype idler() {
	byte d, t;
end_idler:
	do
	:: atomic { timeout && ALLDONE -> skip };
progress_alldone:
		skip
	:: atomic {                          /* every running dispatcher polls */
		timeout && !ALLDONE ->
		if :: ph[0] == P_RUN -> d = 0; poll(d) :: else -> skip fi;
		if :: ph[1] == P_RUN -> d = 1; poll(d) :: else -> skip fi;
		d = 0; t = 0
	   }
	od
}
#endif

proctype clock() {
	byte m, t;
end_clock:
	do
	:: atomic {
		ANYM(EXPIRABLE) ->
		m = 0;
		do
		:: EXPIRABLE(m) -> break
		:: else -> m++
		od;
		t = tok[m];
		if :: LIVEPH(town[t]) -> nexp++ :: else -> skip fi;
		texp[t] = true;
		EV("EV the lease of m%d under token %d runs out\n", m, t);
		m = 0; t = 0
	   }
	od
}

/* At most one dispatcher failure, at any moment.  A crash ends everything
 * of it at once; its offers stay in the table until they expire (a
 * producer may lease to one while another dispatcher holds the key), its
 * leases run out.  A clean stop (Dispatcher.Run after ctx is done): the
 * lanes and the listener stop; leases waiting for a slot are released;
 * offer_drop.sql deletes its offers, skipping those a producer has locked;
 * the running handler finishes; closeOffers deletes the rest, waiting for
 * any producer that holds one (offer_drop_all.sql), releases the leases
 * found under its other tokens, and closes the book. */
proctype failure() {
	byte f, i, t;
	bool ok;
	if
	:: f = 0
	:: f = 1
	:: goto out       /* under weak fairness, "no failure" must be possible */
	fi;
	if
#ifndef STOP_ONLY
	:: atomic {
		ph[f] = P_DEAD; drop_listener(f); wq[f] = false; slot[f] = 0; rc[f] = false;
		rset[f] = 0; fnd[f] = 0; gone[f] = 0; npend[f] = 0;
		if :: mk[f] != 0 -> if :: orow[mk[f]] = O_FREE :: skip fi; mk[f] = 0 :: else -> skip fi;
		t = 1;
		do
		:: t < NTOK -> if :: town[t] == f -> bk[t] = B_NONE; pendl[t] = false :: else -> skip fi; t++
		:: else -> break
		od;
		EV("EV d%d CRASHES\n", f)
	   }
#endif
#ifndef CRASH_ONLY
	:: atomic {
		ph[f] = P_STOP; drop_listener(f); wq[f] = false; rc[f] = false; rset[f] = 0; fnd[f] = 0; gone[f] = 0;
		if :: mk[f] != 0 -> if :: orow[mk[f]] = O_FREE :: skip fi; mk[f] = 0 :: else -> skip fi;
		EV("EV d%d STOPS: lanes and listener stopped; its offers not locked deleted\n", f);
		t = 1;
		do
		:: t < NTOK -> if :: pendl[t] && town[t] == f -> pendl[t] = false; release(t) :: else -> skip fi; t++
		:: else -> break
		od;
		npend[f] = 0;
		t = 1;                           /* offer_drop.sql: ours, skipping locked ones */
		do
		:: t < NTOK -> if :: town[t] == f && orow[t] == O_FREE -> orow[t] = O_NONE; bk[t] = B_NONE :: else -> skip fi; t++
		:: else -> break
		od
	   };
#ifndef FLAW_DROP_SKIP
#define LOCKEDBYF(m) (mst[m] == M_LOCK && town[plk[m]] == f)
	   atomic { slot[f] == 0 && !ANYM(LOCKEDBYF) ->  /* and no producer holds one of its offers */
#else
	   atomic { slot[f] == 0 ->           /* the running handler finished */
#endif
		t = 1;                           /* offer_drop_all.sql: all of ours (FLAW_DROP_SKIP: offer_drop.sql again) */
		do
		:: t < NTOK -> if :: town[t] == f && orow[t] == O_FREE -> orow[t] = O_NONE; bk[t] = B_NONE :: else -> skip fi; t++
		:: else -> break
		od;
		EV("EV d%d deletes its offers\n", f)
	   };
	   atomic {                          /* recoverLeases(the book), released */
		t = 1;
		do
		:: t < NTOK ->
			if
			:: town[t] == f && bk[t] != B_NONE && tmsg[t] != 0 && tok[tmsg[t] - 1] == t ->
				bk[t] = B_NONE; release(t)
			:: else -> skip
			fi; t++
		:: else -> break
		od;
		ph[f] = P_GONE;                  /* the book is closed */
		EV("EV d%d has stopped\n", f)
	   }
#endif
	fi;
out:	skip
}

init {
	atomic {
		key[0] = true; key[1] = true;
		run lane(0); run lane(1);
		run handler(0); run handler(1);
		run listener(0); run listener(1);
		run control(0); run control(1);
#ifndef NO_POLL
		run idler();
#endif
#ifndef NO_EXPIRY
		run clock();
#endif
		run producer(0);
#if NMSG > 1
		run producer(1);
#endif
#if NMSG > 2
		run producer(2);
#endif
#ifndef NO_FAILURE
		run failure();
#endif
	}
}
