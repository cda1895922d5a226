# Timed parts for scripts/test.sh. A part NAME is a shell function run_NAME;
# parts run in lanes, a lane's parts one after the other, the lanes side by
# side. Each part's output goes to a log of its own, printed whole when its
# lane is waited for (concurrent parts never interleave); its start and end
# are printed as they happen, and a summary lists every part's time and
# outcome. A part that fails does not stop its lane: every part runs, and
# the summary fails. Source it; it defines functions only.
#
#   parts_init DIR          logs and times under DIR (emptied)
#   part NAME               runs run_NAME now, its output shown as it comes
#   lane LANE NAME...       starts a lane in the background
#   lane_wait LANE...       waits for lanes, prints their parts' logs
#   parts_summary           prints the table; false when a part failed

PARTS_DIR=""
PARTS_STARTED=0
PARTS_ORDER=()
declare -A LANE_PID=() LANE_PARTS=()

parts_init() {
  PARTS_DIR=$1
  PARTS_STARTED=$SECONDS
  rm -rf "$PARTS_DIR"
  mkdir -p "$PARTS_DIR"
}

# _part_run NAME: runs run_NAME, then writes "SECONDS EXIT_CODE START" to
# NAME.time; returns 0. run_NAME runs as a job of its own and is waited for,
# and _part_run is never called left of `||`: either would have `set -e`
# ignored in the whole body of run_NAME.
_part_run() {
  local name=$1 started=$SECONDS rc=0
  "run_$name" &
  wait $! || rc=$?
  echo "$((SECONDS - started)) $rc $((started - PARTS_STARTED))" >"$PARTS_DIR/$name.time"
}

# _part_line NAME: "==> NAME: N s" (and the failure) from NAME.time.
_part_line() {
  local seconds rc
  read -r seconds rc _ <"$PARTS_DIR/$1.time"
  echo "==> $1: $seconds s$( ((rc == 0)) || echo ", FAILED (exit $rc)")"
}

part() {
  PARTS_ORDER+=("$1")
  echo "==> $1"
  _part_run "$1"
  _part_line "$1"
}

# part_failed NAME: whether the part ran and failed.
part_failed() {
  local rc
  read -r _ rc _ <"$PARTS_DIR/$1.time"
  ((rc != 0))
}

lane() {
  local lane=$1 name
  shift
  PARTS_ORDER+=("$@")
  LANE_PARTS[$lane]="$*"
  (
    for name in "$@"; do
      echo "==> $name: started (lane $lane)"
      _part_run "$name" </dev/null >"$PARTS_DIR/$name.log" 2>&1
      _part_line "$name"
    done
  ) &
  LANE_PID[$lane]=$!
}

lane_wait() {
  local lane name
  for lane in "$@"; do
    wait "${LANE_PID[$lane]}" || true
    unset "LANE_PID[$lane]" # ended: lanes_kill must not signal a reused pid
    for name in ${LANE_PARTS[$lane]}; do
      [[ -f $PARTS_DIR/$name.time ]] || echo "1 1 0" >"$PARTS_DIR/$name.time"
      echo "==> $name (lane $lane): its output"
      cat "$PARTS_DIR/$name.log" 2>/dev/null || true
      _part_line "$name"
    done
  done
}

# lanes_kill: stops the lanes still running (on an exit before they were
# waited for) and every process they started, by process id.
lanes_kill() {
  local pid
  for pid in "${LANE_PID[@]}"; do
    _kill_tree "$pid"
  done
}

_kill_tree() {
  local child
  for child in $(pgrep -P "$1" 2>/dev/null); do
    _kill_tree "$child"
  done
  kill -TERM "$1" 2>/dev/null || true
}

parts_summary() {
  local name seconds rc start failed=0
  echo "==> parts: started at (s into the run), took, outcome; the whole run $((SECONDS - PARTS_STARTED)) s"
  for name in "${PARTS_ORDER[@]}"; do
    read -r seconds rc start <"$PARTS_DIR/$name.time"
    printf '    %-14s +%-5s %5s s  %s\n' "$name" "$start" "$seconds" \
      "$( ((rc == 0)) && echo ok || echo "FAILED (exit $rc)")"
    ((rc == 0)) || failed=1
  done
  ((failed == 0))
}
