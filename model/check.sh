#!/usr/bin/env bash
# Model-checks busymark.pml (README.md) and offers.pml (OFFERS.md) with spin.
#
#   ./check.sh            the quick set (about 7 minutes on 2 CPUs): the
#                         protocols are safe and live; every broken variant
#                         is caught
#   ./check.sh full       also the larger configurations (about 30 minutes)
#   ./check.sh trail RUN  replays RUN's shortest counterexample as events
#   ./check.sh select RE  the runs whose names match the regex RE, from
#                         both sets (e.g. 'offers-')
#   ./check.sh list       lists the runs
#
# Runs go in parallel, JOBS at a time (default: the number of CPUs).
# Exits non-zero if a run that must pass finds an error, if a run that must
# fail finds none (the model could not tell), or if a search is incomplete.
# Needs spin and gcc (apt-get install spin gcc).
set -euo pipefail
cd "$(dirname "$0")"

OUT=out
PAN_M=-m4000000            # search depth limit (never reached: checked below)
# State compression: lossless (same states, same verdicts) but about a
# quarter slower. The full set needs it: its largest runs take up to 8 GB
# with it, two at a time. The quick set does not: its largest runs
# (offers-crash, offers-stop) take 2.8 GB without it, against 1.6 GB with
# it; run together on the 2-CPU machine, interleaved, the pair took 236
# and 239 s without it against 318 and 347 s with it (2026-12-03).
COMPRESS=-DCOLLAPSE

# name | expect (pass|fail) | mode (safe|live|prog) | spin -D flags [| model]
# The model is busymark.pml unless named.  Modes: safe, the LTL claim
# "safe" (pan -N safe, compiled -DSAFETY); live, the LTL claim "liveness"
# under weak fairness (pan -a -f); prog, non-progress cycles (pan -l,
# compiled -DNP).
# busymark.pml sizes: NMSG 3 messages unless -DNMSG, NDROP 1 dropped lock
# session unless -DNDROP (README.md, "Results").  offers.pml sizes: NMSG 2,
# NOFF 2, NDROP 1, NEXP 1, NPOLL 1, NLOSE 0 (OFFERS.md, "Results").
QUICK='
safe            |pass|safe|-DNMSG=2 -DSYNC_NOTIFY
safe-impl       |pass|safe|-DMARK_NEXT -DMARK_WATCH -DNMSG=2 -DSYNC_NOTIFY
safe-async      |pass|safe|-DNMSG=2 -DNDROP=0
live            |pass|live|-DNMSG=2 -DSYNC_NOTIFY
flaw-no-lockwait     |fail|safe|-DFLAW_NO_LOCKWAIT -DSYNC_NOTIFY
flaw-early-read      |fail|safe|-DFLAW_EARLY_READ -DNO_FAILURE -DNDROP=0 -DNO_EXPIRY -DSYNC_NOTIFY
flaw-no-free-check   |fail|safe|-DFLAW_NO_FREE_CHECK -DNMSG=2 -DSYNC_NOTIFY
flaw-watch-row-only  |fail|safe|-DFLAW_WATCH_ROW_ONLY -DNMSG=2 -DCRASH_ONLY -DNDROP=0 -DSYNC_NOTIFY
flaw-hold-silent     |fail|safe|-DFLAW_HOLD_SILENT -DMARK_NEXT -DNMSG=2 -DCRASH_ONLY -DNDROP=0 -DNO_EXPIRY -DSYNC_NOTIFY
flaw-timer-idle      |fail|safe|-DFLAW_TIMER_IDLE -DNMSG=2 -DNDROP=0 -DSYNC_NOTIFY
flaw-settle-mark     |fail|safe|-DFLAW_SETTLE_MARK -DSYNC_NOTIFY
flaw-last-pass       |fail|safe|-DFLAW_LAST_PASS -DNMSG=4 -DSTOP_ONLY -DNDROP=0 -DNO_EXPIRY -DSYNC_NOTIFY
flaw-wake-idle       |fail|safe|-DFLAW_WAKE_IDLE -DSTOP_ONLY -DNDROP=0 -DNO_EXPIRY -DSYNC_NOTIFY
flaw-skip            |fail|safe|-DFLAW_SKIP -DCRASH_ONLY -DNDROP=0 -DNO_EXPIRY -DSYNC_NOTIFY
impl-as-designed     |fail|safe|-DMARK_NEXT -DFLAW_LAST_PASS -DFLAW_WAKE_IDLE -DFLAW_SKIP -DSTOP_ONLY -DNDROP=0 -DNO_EXPIRY -DSYNC_NOTIFY
live-flaw-timer-idle |fail|live|-DFLAW_TIMER_IDLE -DNMSG=2 -DNDROP=0 -DSYNC_NOTIFY
offers-safe          |pass|safe|-DNO_POLL -DNO_EXPIRY -DNO_FAILURE -DNOFF=1 |offers.pml
offers-poll          |pass|prog|-DNO_EXPIRY -DNO_FAILURE -DNOFF=1 -DNDROP=0 |offers.pml
offers-lose          |pass|prog|-DNLOSE=1 -DNO_EXPIRY -DNO_FAILURE -DNOFF=1 -DNDROP=0 |offers.pml
offers-crash         |pass|prog|-DCRASH_ONLY -DNEXP=0 -DNOFF=1 -DNDROP=0 |offers.pml
offers-stop          |pass|prog|-DSTOP_ONLY -DNEXP=0 -DNOFF=1 -DNDROP=0 |offers.pml
offers-flaw-token-twice  |fail|safe|-DFLAW_TOKEN_TWICE -DNO_POLL -DNO_EXPIRY -DNO_FAILURE -DNOFF=1 |offers.pml
offers-flaw-no-recovery  |fail|safe|-DFLAW_NO_RECOVERY -DNO_POLL -DNO_EXPIRY -DNO_FAILURE -DNOFF=1 |offers.pml
offers-flaw-share-offer  |fail|safe|-DFLAW_SHARE_OFFER -DNO_POLL -DNO_EXPIRY -DNO_FAILURE -DNOFF=1 |offers.pml
offers-flaw-forget-gone  |fail|prog|-DFLAW_FORGET_GONE -DNO_EXPIRY -DNO_FAILURE -DNOFF=1 -DNDROP=0 |offers.pml
offers-flaw-short-forget |fail|prog|-DFLAW_SHORT_FORGET -DNO_EXPIRY -DNO_FAILURE -DNOFF=1 -DNDROP=0 |offers.pml
offers-flaw-late-start   |fail|prog|-DFLAW_LATE_START -DNO_FAILURE -DNOFF=1 -DNDROP=0 |offers.pml
offers-flaw-drop-skip    |fail|prog|-DFLAW_DROP_SKIP -DSTOP_ONLY -DNEXP=0 -DNOFF=1 -DNDROP=0 |offers.pml
offers-flaw-no-owner-key |fail|prog|-DFLAW_NO_OWNER_KEY -DCRASH_ONLY -DNEXP=0 -DNOFF=1 -DNDROP=0 |offers.pml
'
FULL='
safe-3          |pass|safe|-DSYNC_NOTIFY
safe-impl-3     |pass|safe|-DMARK_NEXT -DMARK_WATCH -DSYNC_NOTIFY
safe-async-drop |pass|safe|-DNMSG=2
safe-async-3    |pass|safe|-DNDROP=0
safe-cap2       |pass|safe|-DCAP=2 -DNMSG=4 -DNDROP=0 -DSYNC_NOTIFY
safe-3prod      |pass|safe|-DNPROD=3 -DNDROP=0 -DSYNC_NOTIFY
safe-impl-async |pass|safe|-DMARK_NEXT -DMARK_WATCH -DNMSG=2
live-3          |pass|live|-DSYNC_NOTIFY
live-impl       |pass|live|-DMARK_NEXT -DMARK_WATCH -DNMSG=2 -DSYNC_NOTIFY
live-async      |pass|live|-DNMSG=2
impl-no-failure |pass|safe|-DMARK_NEXT -DFLAW_LAST_PASS -DFLAW_WAKE_IDLE -DFLAW_SKIP -DNO_FAILURE -DNMSG=2
no-row-notify   |pass|safe|-DNO_ROW_NOTIFY -DMARK_NEXT -DMARK_WATCH -DNMSG=2 -DSYNC_NOTIFY
no-row          |pass|safe|-DNO_ROW -DMARK_NEXT -DMARK_WATCH -DSYNC_NOTIFY
hold-err-forget |pass|safe|-DHOLD_ERR_FORGET -DNMSG=2 -DSYNC_NOTIFY
settle-mark-no-assert |pass|safe|-DFLAW_SETTLE_MARK -DNO_MARK_ASSERT -DNMSG=2 -DSYNC_NOTIFY
offers-safe-2        |pass|safe|-DNO_POLL -DNO_EXPIRY -DNO_FAILURE |offers.pml
offers-poll-drop     |pass|prog|-DNO_EXPIRY -DNO_FAILURE -DNOFF=1 |offers.pml
offers-expiry        |pass|prog|-DNO_FAILURE -DNOFF=1 -DNDROP=0 |offers.pml
'

command -v spin >/dev/null || { echo "check.sh: spin not found (apt-get install spin)" >&2; exit 2; }
command -v gcc >/dev/null || { echo "check.sh: gcc not found" >&2; exit 2; }

runs() {  # prints the selected run lines, trimmed
	printf '%s\n' "$@" | sed -e 's/[[:space:]]*|/|/g' -e '/^[[:space:]]*$/d'
}

find_run() {  # name -> line
	runs "$QUICK" "$FULL" | awk -F'|' -v n="$1" '$1 == n { print; found = 1 } END { exit !found }'
}

# build DIR FLAGS MODE MODEL [extra gcc flags]: spin -a and gcc in DIR
build() {
	local dir=$1 flags=$2 mode=$3 model=$4 extra=${5:-}
	mkdir -p "$dir"
	cp "$model" "$dir/"
	(
		cd "$dir"
		# shellcheck disable=SC2086
		spin -a $flags "$model" </dev/null >spin.log 2>&1 || { cat spin.log >&2; exit 1; }
		local cc="-O2 -w $COMPRESS -DNFAIR=4"
		[ "$mode" = safe ] && cc="$cc -DSAFETY"
		[ "$mode" = prog ] && cc="$cc -DNP"
		# shellcheck disable=SC2086
		gcc $cc $extra $flags -o pan pan.c </dev/null 2>gcc.log || { cat gcc.log >&2; exit 1; }
	)
}

pan_args() {
	case $1 in
	safe) echo "-N safe $PAN_M" ;;
	prog) echo "-l $PAN_M" ;;
	*) echo "-a -f -N liveness $PAN_M" ;;
	esac
}

# events DIR FLAGS MODEL: the counterexample in DIR as the model's EV lines
events() {
	local what='quiescent, yet a message is unclaimed'
	local cycle='weak fairness: it repeats forever'
	if [ "$3" = offers.pml ]; then
		what='quiescent, yet a message is not acked'
		cycle='only the idle poll runs from here on, and no message is acked'
	fi
	# shellcheck disable=SC2086
	(cd "$1" && spin -t $2 "$3" 2>&1) | sed -n -e 's/^ *EV /  /p' \
		-e "s/^spin: _spin_nvr.tmp:.*assertion violated.*/  ** assertion violated: $what/p" \
		-e '/text of failed assertion: assert(!(!(/d' \
		-e 's/^spin: text of failed assertion: \(.*\)/  ** assertion violated: \1/p' \
		-e "s/^.*\\(<<<<<START OF CYCLE>>>>>\\).*/  ** \\1 ($cycle)/p"
}

do_trail() {
	local line name expect mode flags model dir
	line=$(find_run "$1") || { echo "no run named $1 (./check.sh list)" >&2; exit 2; }
	IFS='|' read -r name expect mode flags model <<<"$line"
	model=${model:-busymark.pml}
	dir=$OUT/$name-bfs
	if [ "$mode" = safe ]; then build "$dir" "$flags" "$mode" "$model" -DBFS; else build "$dir" "$flags" "$mode" "$model"; fi
	# shellcheck disable=SC2046
	(cd "$dir" && ./pan $(pan_args "$mode") </dev/null >pan.log 2>&1) || true
	grep -E 'errors:|states, stored' "$dir/pan.log" || true
	echo "spin $flags $model  (./check.sh trail $name):"
	events "$dir" "$flags" "$model"
}

# run_one NAME EXPECT MODE FLAGS MODEL: one run; its line of the table goes
# to $OUT/NAME/result, "ok" first when it gave the expected result
run_one() {
	local name=$1 expect=$2 mode=$3 flags=$4 model=$5 bflags dir t0 t1 log errs states verdict
	dir=$OUT/$name
	rm -rf "$dir"
	mkdir -p "$dir"
	t0=$(date +%s.%N)
	# events are printed only when a counterexample is replayed; they
	# cost states, so runs that must pass leave them out
	bflags=$flags
	[ "$expect" = pass ] && bflags="$flags -DNO_EV"
	if ! build "$dir" "$bflags" "$mode" "$model" 2>"$dir/build.err"; then
		printf '%-26s %s\n' "$name" "BROKEN: build failed: $(head -3 "$dir/build.err")" >"$dir/result"
		return
	fi
	log=$dir/pan.log
	# shellcheck disable=SC2046
	(cd "$dir" && ./pan $(pan_args "$mode") </dev/null >pan.log 2>&1) || true
	t1=$(date +%s.%N)
	errs=$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' "$log" | tail -1)
	states=$(sed -n 's/^ *\([0-9.e+]*\) states, stored.*/\1/p' "$log" | tail -1)
	verdict=ok
	if [ -z "$errs" ]; then
		verdict="BROKEN: pan did not finish (see $log)"
	elif [ "$expect" = pass ] && [ "$errs" != 0 ]; then
		verdict="FAILED: $errs error(s); counterexample: ./check.sh trail $name"
	elif grep -qE 'max search depth too small|out of memory' "$log" ||
		{ [ "$expect" = pass ] && grep -q 'Search not completed' "$log"; }; then
		verdict="BROKEN: incomplete search (see $log)"
	elif [ "$expect" = fail ] && [ "$errs" = 0 ]; then
		verdict="FAILED: the broken variant was not caught"
	elif [ "$expect" = fail ]; then
		if [ "$mode" = safe ] && ! grep -q 'assertion violated' "$log"; then
			verdict="FAILED: caught, but not by an assertion (see $log)"
		elif [ "$mode" = live ] && ! grep -q 'acceptance cycle' "$log"; then
			verdict="FAILED: caught, but not as an acceptance cycle (see $log)"
		elif [ "$mode" = prog ] && ! grep -qE 'non-progress cycle|assertion violated' "$log"; then
			verdict="FAILED: caught, but not as a non-progress cycle or an assertion (see $log)"
		else
			verdict="ok, caught (events: $dir/events.txt)"
			events "$dir" "$flags" "$model" >"$dir/events.txt" || true
		fi
	fi
	printf '%-26s %-6s %-5s %12s %8.1f  %s\n' "$name" "$expect" "$mode" "${states:-?}" \
		"$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')" "$verdict" >"$dir/result"
}

do_runs() {
	local jobs=${JOBS:-$(nproc 2>/dev/null || echo 2)} lines line name expect mode flags model failures=0
	mapfile -t lines
	if [ "${#lines[@]}" -eq 0 ]; then
		echo "check.sh: no run selected (./check.sh list)" >&2
		return 2
	fi
	for line in "${lines[@]}"; do
		IFS='|' read -r name expect mode flags model <<<"$line"
		run_one "$name" "$expect" "$mode" "$flags" "${model:-busymark.pml}" &
		while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
	done
	wait
	printf '%-26s %-6s %-5s %12s %8s  %s\n' run expect mode states seconds result
	for line in "${lines[@]}"; do
		name=${line%%|*}
		if [ -f "$OUT/$name/result" ]; then cat "$OUT/$name/result"; else echo "$name: no result"; fi
		grep -qE '^[^ ]+ +(pass|fail) +(safe|live|prog) +[^ ]+ +[^ ]+  ok' "$OUT/$name/result" 2>/dev/null ||
			failures=$((failures + 1))
	done
	if [ "$failures" -ne 0 ]; then
		echo "check.sh: $failures run(s) did not give the expected result" >&2
		return 1
	fi
	echo "check.sh: all ${#lines[@]} runs gave the expected result"
}

case ${1:-quick} in
quick) COMPRESS= && runs "$QUICK" | do_runs ;;
full) runs "$QUICK" "$FULL" | do_runs ;;
trail) do_trail "${2:?usage: ./check.sh trail RUN}" ;;
select) runs "$QUICK" "$FULL" | grep -E "^(${2:?usage: ./check.sh select REGEX})" | do_runs ;;
list) runs "$QUICK" "$FULL" ;;
*) echo "usage: ./check.sh [quick|full|trail RUN|select REGEX|list]" >&2; exit 2 ;;
esac
