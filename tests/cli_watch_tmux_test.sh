#!/usr/bin/env bash
# `fracgpu status --watch` and `fracgpu top` in a real terminal: tmux runs a
# shell in a detached session of fixed size, the test types the commands
# (send-keys) and reads the screen (capture-pane). fracgpud runs on the
# simulated driver with two tenants, each running a saturating load under
# the interposer, so the GPU-time columns have figures.
#
# Checked: the header and one row per tenant with its name and share; a
# redraw in place (the clock moves, yet the screen and its scrollback hold
# one title and one table header: nothing scrolled); the cursor hidden and
# line wrap off while it runs; a smaller window cut to fit; a daemon that
# goes away said so on screen while the view carries on; Ctrl-C, SIGTERM
# and Ctrl-Z/fg leaving exit code 0, the cursor shown, wrap on and the shell
# prompt back.
#
#   cli_watch_tmux_test.sh FRACGPU FRACGPUD SIMCUDA_DIR SIMNVML_DIR LIBFRACGPU GPUTIME_LOAD
# Exit 0 passed, 1 failed, 77 skipped (no tmux).
set -euo pipefail

if [ $# -ne 6 ]; then
  echo "usage: $0 FRACGPU FRACGPUD SIMCUDA_DIR SIMNVML_DIR LIBFRACGPU GPUTIME_LOAD" >&2
  exit 2
fi
cli=$1 fracgpud=$2 simcuda=$3 simnvml=$4 lib=$5 load=$6
if ! command -v tmux >/dev/null 2>&1; then
  echo "SKIPPED: tmux is not installed (scripts/install-deps.sh installs it)"
  exit 77
fi

tmp=$(mktemp -d /tmp/fracgpu-watch-XXXXXX)
run=$tmp/run
uuid=GPU-5eed0000-0000-4000-8000-0000000000a1
export SIMCUDA_STATE=$tmp/simulated-gpu
export SIMCUDA_DEVICES="uuid=$uuid,mem=16GiB,ctx=64MiB"
pids=()

tmux() { command tmux -S "$tmp/tmux.sock" -f /dev/null "$@"; }
screen() { tmux capture-pane -p -t view; }
pane() { tmux display-message -p -t view "$1"; }

cleanup() {
  tmux kill-server 2>/dev/null || true
  for pid in ${pids[@]+"${pids[@]}"}; do kill -KILL "$pid" 2>/dev/null || true; done
  for pid in ${pids[@]+"${pids[@]}"}; do wait "$pid" 2>/dev/null || true; done
  # The tmux server ends its shell in its own time: retry for a moment.
  for _ in 1 2 3 4 5; do rm -rf "$tmp" 2>/dev/null && break; sleep 0.2; done
}
trap cleanup EXIT

fail() {
  echo "FAIL: $*" >&2
  echo "--- the screen:" >&2
  screen >&2 2>/dev/null || true
  echo "--- fracgpud's log (last lines):" >&2
  tail -n 20 "$tmp/fracgpud.log" >&2 2>/dev/null || true
  exit 1
}

# until SECONDS COMMAND...: polls COMMAND every 0.1 s; false after SECONDS.
until_true() {
  local tries=$(($1 * 10))
  shift
  for ((i = 0; i < tries; i++)); do
    if "$@"; then return 0; fi
    sleep 0.1
  done
  return 1
}

# Lines of the screen (or of stdin) matching an extended regex.
count() { grep -cE -- "$1" || true; }
screen_has() { screen | grep -qE -- "$1"; }
# A tenant's 1S cell on the screen, without "%" ("-" before the second
# frame; empty if there is no such row).
one_second() {
  screen | awk -v t="$1" '
    /^GPU +TENANT/ { col = index($0, " 1S") + 1 }
    col > 1 && $0 ~ " " t " " { split(substr($0, col), cell, " "); v = cell[1]; sub(/%\*?$/, "", v); print v; exit }'
}
has_share() { local v; v=$(one_second "$1"); [ -n "$v" ] && [ "$v" != - ]; }
# Types a command line into the pane's shell.
type_line() {
  tmux send-keys -t view -l "$1"
  tmux send-keys -t view Enter
}
at_prompt() { [ "$(screen | grep -v '^$' | tail -n 1)" = 'watch-test$' ]; }
# The PID of the program the shell runs in the foreground.
foreground_pid() { ps -o pid= --ppid "$(pane '#{pane_pid}')" | head -n 1 | tr -d ' '; }

# ---- fracgpud on the simulated GPU: alice 0.25, bob 0.5 ----
mkdir -p "$run"
cat >"$tmp/fracgpud.toml" <<EOF
[daemon]
run_dir = "$run"
reap_interval_ms = 100
metrics_address = "off"

[[gpu]]
uuid = "$uuid"
context_memory = "64MiB"

[[tenant]]
name = "alice"
gpus = 0.25

[[tenant]]
name = "bob"
gpus = 0.5
EOF
LD_LIBRARY_PATH="$simnvml:$simcuda" "$fracgpud" --config "$tmp/fracgpud.toml" 2>"$tmp/fracgpud.log" &
daemon=$!
pids+=("$daemon")
until_true 20 test -e "$run/tenants/alice/gputime-0" -a -e "$run/tenants/bob/gputime-0" ||
  fail "fracgpud did not set up its tenants"
for tenant in alice bob; do
  FRACGPU_TENANT=$tenant FRACGPU_RUN_DIR=$run LD_PRELOAD=$lib LD_LIBRARY_PATH=$simcuda \
    "$load" devices=0 kernels_us=5000 seconds=60 >"$tmp/load-$tenant.out" 2>&1 &
  pids+=("$!")
done

# ---- a shell in a 132x30 terminal ----
tmux new-session -d -s view -x 132 -y 30 \
  "env -i HOME=$tmp HISTFILE= PATH=/usr/bin:/bin TERM=xterm-256color PS1='watch-test\$ ' bash --norc --noprofile -i"
tmux set-option -t view status off >/dev/null
until_true 10 at_prompt || fail "the shell in tmux did not start"

watch_cmd=$(printf '%q status --watch 1 --run-dir %q; echo "exit=$?" >%q' "$cli" "$run" "$tmp/rc")
type_line "$watch_cmd"
# The second frame onwards has the 1 s window.
until_true 15 screen_has '^GPU +TENANT +SHARE +LIMIT +1S +10S +MEMORY +THROTTLED +PRIORITY +HEALTH$' ||
  fail "no table header"
until_true 15 has_share alice || fail "alice's 1S never filled"
until_true 15 has_share bob || fail "bob's 1S never filled"
first=$(screen)
echo "--- status --watch 1, first capture:"
echo "$first"
[ "$(echo "$first" | count '^fracgpu status --watch on ')" = 1 ] || fail "not exactly one title line"
[ "$(echo "$first" | count '^GPU +TENANT ')" = 1 ] || fail "not exactly one table header"
echo "$first" | grep -qE '^daemon: alive \(pid [0-9]+' || fail "the daemon's state is not shown as alive"
share='[0-9.]+%\*?'
echo "$first" | grep -qE "^(0|GPU-5eed0000) +alice +0\.25 +0\.25 +$share +$share +[0-9.]+ [KMG]?i?B / 4 GiB " ||
  fail "no row for alice with share 0.25, two GPU-time shares and its memory"
echo "$first" | grep -qE "^ +bob +0\.5 +0\.5 +$share +$share " ||
  fail "no row for bob (same GPU: blank GPU cell) with share 0.5"
[ "$(echo "$first" | count ' (alice|bob) ')" = 2 ] || fail "not exactly one row per tenant"
for tenant in alice bob; do
  awk -v v="$(one_second "$tenant")" 'BEGIN { exit !(v + 0 > 0) }' ||
    fail "$tenant's GPU time over the last second is not above 0 while its load runs"
done
[ "$(pane '#{cursor_flag}')" = 0 ] || fail "the cursor is not hidden while the view runs"
[ "$(pane '#{wrap_flag}')" = 0 ] || fail "line wrap is not off while the view runs"

sleep 2.2
second=$(screen)
echo "--- second capture, 2.2 s later:"
echo "$second"
[ "$(echo "$first" | head -n 1)" != "$(echo "$second" | head -n 1)" ] || fail "the clock did not move: no redraw"
[ "$(echo "$second" | count '^fracgpu status --watch on ')" = 1 ] || fail "not exactly one title line after redraws"
[ "$(echo "$second" | count '^GPU +TENANT ')" = 1 ] || fail "not exactly one table header after redraws"
# Scrollback and screen together: redrawn in place, nothing scrolled away.
history=$(tmux capture-pane -p -S - -t view)
[ "$(echo "$history" | count '^fracgpu status --watch on ')" = 1 ] ||
  fail "frames scrolled: more than one title in the scrollback"

# A smaller window: the frame is cut to it (no wrapped lines, no scrolling).
tmux resize-window -t view -x 60 -y 8
sleep 1.5
small=$(screen)
echo "--- at 60x8:"
echo "$small"
[ "$(echo "$small" | count '^fracgpu status --watch on ')" = 1 ] || fail "no title line at 60x8"
echo "$small" | grep -qE '^\.\.\. [0-9]+ more lines?: enlarge the window$' || fail "the frame is not cut to 8 rows"
echo "$small" | awk 'length($0) > 60 { exit 1 }' || fail "a line is wider than the window"
tmux resize-window -t view -x 132 -y 30
sleep 1.5
screen_has '^GPU +TENANT ' || fail "no table after growing the window back"

# The daemon goes away: the view says so and carries on.
kill -TERM "$daemon"
wait "$daemon" || true
until_true 8 screen_has '^daemon: NOT RUNNING' || fail "a stopped daemon is not shown as NOT RUNNING"
screen_has '^fracgpud is not running: ' || fail "no line saying fracgpud is not running"
command=$(pane '#{pane_current_command}')
[ "${command##*/}" = fracgpu ] || fail "the view did not carry on without the daemon (the pane runs $command)"
echo "--- after fracgpud stopped:"
screen

# Ctrl-C: exit code 0, the terminal as it was, the prompt back.
tmux send-keys -t view C-c
until_true 5 test -s "$tmp/rc" || fail "the view did not end on Ctrl-C"
[ "$(cat "$tmp/rc")" = exit=0 ] || fail "exit code after Ctrl-C: $(cat "$tmp/rc"), wanted 0"
until_true 5 at_prompt || fail "no shell prompt after Ctrl-C"
[ "$(pane '#{cursor_flag}')" = 1 ] || fail "the cursor is still hidden after Ctrl-C"
[ "$(pane '#{wrap_flag}')" = 1 ] || fail "line wrap is still off after Ctrl-C"
echo "--- after Ctrl-C:"
screen | grep -v '^$' | tail -n 3

# top, ended by SIGTERM, sorted by memory.
rm -f "$tmp/rc"
top_cmd=$(printf '%q top --sort memory --interval 0.5 --run-dir %q; echo "exit=$?" >%q' "$cli" "$run" "$tmp/rc")
type_line "clear; $top_cmd"
until_true 10 screen_has '^fracgpu top on .* every 0\.5 s, by memory used$' || fail "top did not draw its title"
until_true 5 screen_has '^GPU +TENANT ' || fail "top did not draw its table"
top_pid=$(foreground_pid)
[ -n "$top_pid" ] || fail "no foreground process for top"
kill -TERM "$top_pid"
until_true 5 test -s "$tmp/rc" || fail "top did not end on SIGTERM"
[ "$(cat "$tmp/rc")" = exit=0 ] || fail "exit code after SIGTERM: $(cat "$tmp/rc"), wanted 0"
until_true 5 at_prompt || fail "no shell prompt after SIGTERM"
[ "$(pane '#{cursor_flag}')" = 1 ] || fail "the cursor is still hidden after SIGTERM"

# Ctrl-Z gives the terminal back while stopped; fg draws again; Ctrl-C ends it.
type_line "clear; $(printf '%q status --watch 0.5 --run-dir %q' "$cli" "$run")"
# Its own title (top's frame is still on screen until the shell runs the
# line): once drawn, the view has its signals in hand.
until_true 10 screen_has '^fracgpu status --watch on .* every 0\.5 s' || fail "status --watch 0.5 did not draw"
tmux send-keys -t view C-z
until_true 5 screen_has 'Stopped' || fail "Ctrl-Z did not stop the view"
until_true 5 at_prompt || fail "no shell prompt while the view is stopped"
[ "$(pane '#{cursor_flag}')" = 1 ] || fail "the cursor is hidden while the view is stopped"
type_line fg
until_true 5 test "$(pane '#{cursor_flag}')" = 0 || fail "the cursor is not hidden again after fg"
until_true 5 screen_has '^GPU +TENANT ' || fail "no table after fg"
sleep 0.6  # a frame more
[ "$(screen | count '^fracgpu status --watch on ')" = 1 ] || fail "not exactly one title line after fg"
tmux send-keys -t view C-c
until_true 5 at_prompt || fail "no shell prompt after Ctrl-C of the resumed view"
type_line "$(printf 'echo "exit=$?" >%q' "$tmp/rc")"
until_true 5 grep -q . "$tmp/rc" || fail "no exit code after fg"
[ "$(cat "$tmp/rc")" = exit=0 ] || fail "exit code after Ctrl-Z, fg, Ctrl-C: $(cat "$tmp/rc"), wanted 0"
[ "$(pane '#{cursor_flag}')" = 1 ] || fail "the cursor is still hidden at the end"

echo "PASS: fracgpu status --watch and fracgpu top in tmux"
