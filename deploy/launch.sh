#!/usr/bin/env bash
# Run the graphlane daemon on a host without systemd: pidfile, log file,
# readiness wait, graceful stop. See deploy/README.md and `launch.sh --help`.
set -euo pipefail

PROG=${0##*/}
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
readonly PROG SCRIPT_DIR DEFAULT_LISTEN="tcp://127.0.0.1:7450"

usage() {
  cat <<EOF
usage: $PROG start|stop|status|restart [options]

Run one graphlane daemon (one worker process per device) in the background.

commands:
  start     start the daemon and wait until every worker is ready
  stop      SIGTERM the daemon (it drains and exits), SIGKILL after --stop-timeout
  status    print \`graphlane status\` for the running daemon
  restart   stop, then start with the given options

options:
  --config FILE          TOML configuration (default: \$GRAPHLANE_CONFIG, else none:
                         graphlane's built-in defaults)
  --backend sim|npu      override the config's backend
  --devices N|LIST       override the config's devices: a count (4) or ids (0,3)
  --listen ENDPOINT      override the config's listen (tcp://HOST:PORT or ipc://PATH)
  --log-level LEVEL      graphlane's logging level (default INFO)
  --env-file FILE        start: add FILE's VAR=value lines to the daemon's environment
                         (systemd's EnvironmentFile format, e.g. systemd/graphlane.env:
                         CANN's variables, HCCL's settings for tensor-parallel groups)
  --numa NODE            run under \`numactl --cpunodebind=NODE --membind=NODE\`
                         (fails if numactl is missing)
  --run-dir DIR          pidfile, log and endpoint files (default: \$GRAPHLANE_RUN_DIR,
                         else /run/graphlane for root, \$XDG_RUNTIME_DIR/graphlane
                         otherwise, else \${TMPDIR:-/tmp}/graphlane-\$UID)
  --log-file FILE        daemon output (default: RUN_DIR/graphlane.log, appended)
  --ready-timeout SEC    start: how long to wait for readiness (default 600)
  --stop-timeout SEC     stop: SIGKILL after this long (default 60; keep it above the
                         config's shutdown_timeout_s + 10)
  --json                 status: print the daemon's status as JSON only
  -h, --help             this help

The endpoint that start/status/stop talk to is --listen, else the config's
top-level \`listen\`, else $DEFAULT_LISTEN; start records it in RUN_DIR.
A wildcard tcp host (0.0.0.0 or *) is reached through 127.0.0.1.

exit codes: 0 success; 1 failure (start: already running, daemon exited or not
ready in time; status: daemon not answering); 2 usage; 3 status: not running.

graphlane executable: \$GRAPHLANE_BIN, else \`graphlane\` on PATH, else the
repository's .venv/bin/graphlane; here: $(find_graphlane 2>/dev/null || echo "not found")
EOF
}

die() {
  echo "$PROG: $*" >&2
  exit 1
}

usage_error() {
  echo "$PROG: $*" >&2
  echo "try '$PROG --help'" >&2
  exit 2
}

find_graphlane() {
  if [[ -n ${GRAPHLANE_BIN:-} ]]; then
    [[ -x $GRAPHLANE_BIN ]] || { echo "GRAPHLANE_BIN=$GRAPHLANE_BIN is not executable" >&2; return 1; }
    echo "$GRAPHLANE_BIN"
  elif command -v graphlane >/dev/null 2>&1; then
    command -v graphlane
  elif [[ -x $SCRIPT_DIR/../.venv/bin/graphlane ]]; then
    (cd "$SCRIPT_DIR/../.venv/bin" && echo "$PWD/graphlane")
  else
    echo "no graphlane executable: set GRAPHLANE_BIN, put graphlane on PATH or" \
      "create $SCRIPT_DIR/../.venv" >&2
    return 1
  fi
}

default_run_dir() {
  if [[ -n ${GRAPHLANE_RUN_DIR:-} ]]; then
    echo "$GRAPHLANE_RUN_DIR"
  elif [[ $(id -u) -eq 0 ]]; then
    echo /run/graphlane
  elif [[ -n ${XDG_RUNTIME_DIR:-} ]]; then
    echo "$XDG_RUNTIME_DIR/graphlane"
  else
    echo "${TMPDIR:-/tmp}/graphlane-$(id -u)"
  fi
}

# ------------------------------------------------------------------ options
command=""
config=${GRAPHLANE_CONFIG:-}
backend=""
devices=""
listen=""
log_level="INFO"
numa=""
run_dir=""
log_file=""
env_file=""
ready_timeout=600
stop_timeout=60
json=0

need_value() {
  [[ $# -ge 2 && -n $2 ]] || usage_error "$1 needs a value"
}

while [[ $# -gt 0 ]]; do
  case $1 in
    start | stop | status | restart)
      [[ -z $command ]] || usage_error "one command at a time ($command, $1)"
      command=$1
      ;;
    -h | --help)
      usage
      exit 0
      ;;
    --json) json=1 ;;
    --config | --backend | --devices | --listen | --log-level | --numa | --run-dir | \
      --log-file | --env-file | --ready-timeout | --stop-timeout)
      need_value "$@"
      case $1 in
        --config) config=$2 ;;
        --backend) backend=$2 ;;
        --devices) devices=$2 ;;
        --listen) listen=$2 ;;
        --log-level) log_level=$2 ;;
        --numa) numa=$2 ;;
        --run-dir) run_dir=$2 ;;
        --log-file) log_file=$2 ;;
        --env-file) env_file=$2 ;;
        --ready-timeout) ready_timeout=$2 ;;
        --stop-timeout) stop_timeout=$2 ;;
      esac
      shift
      ;;
    --*=*) usage_error "write '${1%%=*} ${1#*=}' (two words), not $1" ;;
    *) usage_error "unknown argument: $1" ;;
  esac
  shift
done

[[ -n $command ]] || usage_error "a command is needed: start, stop, status or restart"
[[ -z $backend || $backend == sim || $backend == npu ]] || usage_error "--backend: sim or npu"
[[ $ready_timeout =~ ^[0-9]+$ ]] || usage_error "--ready-timeout: whole seconds"
[[ $stop_timeout =~ ^[0-9]+$ ]] || usage_error "--stop-timeout: whole seconds"
[[ -z $numa || $numa =~ ^[0-9]+$ ]] || usage_error "--numa: a NUMA node number"
[[ -z $env_file || -r $env_file ]] || die "env file $env_file is not readable"
if [[ -n $config ]]; then
  [[ -r $config ]] || die "config $config is not readable"
  config=$(cd "$(dirname "$config")" && echo "$PWD/$(basename "$config")")
fi

run_dir=${run_dir:-$(default_run_dir)}
pidfile=$run_dir/graphlane.pid
endpoint_file=$run_dir/graphlane.endpoint
lockfile=$run_dir/graphlane.lock
log_file=${log_file:-$run_dir/graphlane.log}

# ------------------------------------------------------------------ helpers
prepare_run_dir() {
  if [[ ! -d $run_dir ]]; then
    mkdir -p -- "$(dirname -- "$run_dir")"
    mkdir -m 0700 -- "$run_dir" 2>/dev/null || [[ -d $run_dir ]] || die "cannot create $run_dir"
  fi
  [[ -O $run_dir ]] || die "run dir $run_dir belongs to another user"
  run_dir=$(cd "$run_dir" && pwd)
  pidfile=$run_dir/graphlane.pid
  endpoint_file=$run_dir/graphlane.endpoint
  lockfile=$run_dir/graphlane.lock
}

# One launch.sh at a time per run dir (fd 9; the daemon does not inherit it).
take_lock() {
  exec 9>"$lockfile"
  if command -v flock >/dev/null 2>&1; then
    flock -w 30 9 || die "another $PROG is working on $run_dir"
  fi
}

# The top-level `listen` of a TOML file: its lines before the first [table].
config_listen() {
  awk '
    /^[[:space:]]*\[/ { exit }
    /^[[:space:]]*listen[[:space:]]*=/ {
      sub(/^[^=]*=[[:space:]]*/, ""); sub(/[[:space:]]*#.*$/, "")
      gsub(/^["\047]|["\047]$/, ""); print; exit
    }' "$1"
}

resolve_listen() {
  local value=$listen
  if [[ -z $value && -n $config ]]; then
    value=$(config_listen "$config")
  fi
  echo "${value:-$DEFAULT_LISTEN}"
}

# Where a client connects to reach a daemon that listens on $1.
connect_endpoint() {
  local ep=$1 rest host port
  case $ep in
    ipc://*) echo "$ep" ;;
    tcp://*)
      rest=${ep#tcp://}
      host=${rest%:*}
      port=${rest##*:}
      [[ $port =~ ^[0-9]+$ && $port != 0 ]] ||
        die "$ep: $PROG needs a fixed tcp port (not 0 or *) to find the daemon"
      [[ $host == "*" || $host == 0.0.0.0 ]] && host=127.0.0.1
      echo "tcp://$host:$port"
      ;;
    *) die "$ep is neither tcp:// nor ipc://" ;;
  esac
}

# The state letter of process $1 (R, S, Z...), or nothing when it is gone.
proc_state() {
  local line fields
  { read -r line <"/proc/$1/stat"; } 2>/dev/null || return 0
  read -ra fields <<<"${line##*) }"
  echo "${fields[0]}"
}

# Alive: it exists and is not a zombie (a zombie has exited; only its status is left).
alive() {
  local state
  state=$(proc_state "$1")
  [[ -n $state && $state != Z ]]
}

is_graphlane() {
  local cmdline
  alive "$1" || return 1
  cmdline=$(tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null) || return 1
  [[ $cmdline == *graphlane* && $cmdline == *serve* ]]
}

# Is any live process left in process group $1 (the daemon leads its own)?
group_alive() {
  local f line fields
  for f in /proc/[0-9]*/stat; do
    { read -r line <"$f"; } 2>/dev/null || continue
    read -ra fields <<<"${line##*) }"
    [[ ${fields[2]} == "$1" && ${fields[0]} != Z ]] && return 0
  done
  return 1
}

# The pid of the running daemon, or nothing. With "clean" (only under the lock:
# a start may be writing them), a stale pidfile and endpoint file are removed.
running_pid() {
  local pid
  [[ -f $pidfile ]] || return 0
  pid=$(<"$pidfile")
  if [[ $pid =~ ^[0-9]+$ ]] && is_graphlane "$pid"; then
    echo "$pid"
  elif [[ ${1:-} == clean ]]; then
    rm -f -- "$pidfile" "$endpoint_file"
  fi
}

# Milliseconds on a clock that only moves forward far enough for our deadlines.
now_ms() {
  local t=${EPOCHREALTIME:-}
  if [[ -n $t ]]; then
    t=${t//[.,]/}
    echo $((10#$t / 1000))
  else
    echo $(($(date +%s%N) / 1000000))
  fi
}

# Wait until pid $1 (and its process group, when it leads one) is gone, at most
# $2 seconds; status 1 at the deadline.
wait_gone() {
  local pid=$1 deadline=$(($(now_ms) + $2 * 1000))
  while alive "$pid" || group_alive "$pid"; do
    (($(now_ms) < deadline)) || return 1
    sleep 0.1
  done
}

log_tail() {
  if [[ -s $log_file ]]; then
    echo "--- last lines of $log_file:" >&2
    tail -n 30 -- "$log_file" >&2
  fi
}

# The VAR=value lines of --env-file into the array env_args (the caller's): comments
# and blank lines skipped, anything else refused naming its line; no shell, so values
# stay verbatim, as systemd reads the same file.
read_env_file() {
  local line n=0
  env_args=()
  while IFS= read -r line || [[ -n $line ]]; do
    n=$((n + 1))
    [[ $line =~ ^[[:space:]]*(#.*)?$ ]] && continue
    [[ $line =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "$env_file:$n: not VAR=value: $line"
    env_args+=("$line")
  done <"$env_file"
}

# ------------------------------------------------------------------ commands
do_start() {
  local bin ep connect pid deadline left wait_s
  bin=$(find_graphlane) || die "cannot start"
  prepare_run_dir
  take_lock
  pid=$(running_pid clean)
  [[ -z $pid ]] || die "graphlane is already running (pid $pid, run dir $run_dir)"

  ep=$(resolve_listen)
  connect=$(connect_endpoint "$ep")
  local -a cmd=()
  if [[ -n $env_file ]]; then
    local -a env_args=()
    read_env_file
    [[ ${#env_args[@]} -eq 0 ]] || cmd+=(env "${env_args[@]}")
  fi
  if [[ -n $numa ]]; then
    command -v numactl >/dev/null 2>&1 ||
      die "--numa $numa: numactl is not installed (apt-get install numactl), or drop --numa"
    cmd+=(numactl "--cpunodebind=$numa" "--membind=$numa")
  fi
  cmd+=("$bin" serve --log-level "$log_level")
  [[ -z $config ]] || cmd+=(--config "$config")
  [[ -z $backend ]] || cmd+=(--backend "$backend")
  [[ -z $devices ]] || cmd+=(--devices "$devices")
  [[ -z $listen ]] || cmd+=(--listen "$listen")

  mkdir -p -- "$(dirname "$log_file")"
  echo "$(date '+%F %T') $PROG: starting: ${cmd[*]}" >>"$log_file"
  # Its own session and process group (no terminal signals; stop can kill the
  # whole group); stdin closed; the lock's fd not inherited.
  if command -v setsid >/dev/null 2>&1; then
    setsid "${cmd[@]}" </dev/null >>"$log_file" 2>&1 9>&- &
  else
    nohup "${cmd[@]}" </dev/null >>"$log_file" 2>&1 9>&- &
  fi
  pid=$!
  echo "$pid" >"$pidfile"
  echo "$connect" >"$endpoint_file"
  echo "graphlane starting (pid $pid, endpoint $connect, log $log_file)"

  deadline=$(($(now_ms) + ready_timeout * 1000))
  local answer="" other=""
  while :; do
    if ! alive "$pid"; then
      local code=0
      wait "$pid" || code=$?
      rm -f -- "$pidfile" "$endpoint_file"
      log_tail
      [[ -z $other ]] ||
        echo "$PROG: meanwhile another daemon answers at $connect: $other" >&2
      die "graphlane exited with status $code before it was ready"
    fi
    left=$(((deadline - $(now_ms) + 999) / 1000))
    if ((left <= 0)); then
      echo "$PROG: not ready within ${ready_timeout} s: stopping it" >&2
      log_tail
      [[ -z $other ]] || echo "$PROG: another daemon answers at $connect: $other" >&2
      stop_pid "$pid" || true
      rm -f -- "$pidfile" "$endpoint_file"
      exit 1
    fi
    # Short waits, so that a daemon that dies is noticed at once.
    wait_s=$((left < 10 ? left : 10))
    if "$bin" status --connect "$connect" --wait "$wait_s" --timeout 2 >/dev/null 2>&1; then
      # Ready, but whose daemon? Another one may hold the endpoint (ours then fails
      # to bind and exits, which the check above reports with its log).
      answer=$("$bin" status --connect "$connect" --timeout 5 2>/dev/null) || answer=""
      other=$(foreign_daemon "$answer" "$pid") && break
      sleep 0.2
    fi
  done
  echo "$answer"
  echo "graphlane ready (pid $pid)"
}

# The number of devices --devices asks for (a count or a list), or nothing.
expected_devices() {
  local list
  if [[ $devices =~ ^[0-9]+$ ]]; then
    echo "$devices"
  elif [[ -n $devices ]]; then
    list=${devices//[^0-9,]/}
    IFS=, read -ra list <<<"$list"
    echo "${#list[@]}"
  fi
}

# Status 0 when `graphlane status` text $1 is of the daemon with pid $2 (and the
# device count --devices asks for); else status 1 and what answered instead.
foreign_daemon() {
  local text=$1 pid=$2 re='\(pid ([0-9]+)\)' answered count want
  [[ $text =~ $re ]] || { echo "an unreadable status"; return 1; }
  answered=${BASH_REMATCH[1]}
  count=$(grep -c '^  device [0-9]*:' <<<"$text" || true)
  want=$(expected_devices)
  if [[ $answered != "$pid" ]]; then
    echo "pid $answered with $count device(s), not ours (pid $pid)"
    return 1
  fi
  if [[ -n $want && $count != "$want" ]]; then
    echo "pid $answered with $count device(s), not the $want asked for"
    return 1
  fi
}

# SIGTERM (the daemon drains its workers and exits 0), SIGKILL to its process
# group after --stop-timeout. Status 0 once everything is gone.
stop_pid() {
  local pid=$1
  kill -TERM "$pid" 2>/dev/null || true
  if wait_gone "$pid" "$stop_timeout"; then
    return 0
  fi
  echo "$PROG: graphlane (pid $pid) did not stop within ${stop_timeout} s of SIGTERM:" \
    "sending SIGKILL to it and its workers" >&2
  if group_alive "$pid"; then
    kill -KILL -- "-$pid" 2>/dev/null || true
  fi
  kill -KILL "$pid" 2>/dev/null || true
  wait_gone "$pid" 10 || die "pid $pid survived SIGKILL"
}

do_stop() {
  local pid
  prepare_run_dir
  take_lock
  pid=$(running_pid clean)
  if [[ -z $pid ]]; then
    echo "graphlane is not running (run dir $run_dir)"
    return 0
  fi
  echo "stopping graphlane (pid $pid)"
  stop_pid "$pid"
  rm -f -- "$pidfile" "$endpoint_file"
  echo "graphlane stopped"
}

do_status() {
  local bin pid connect
  pid=$(running_pid)
  if [[ -z $pid ]]; then
    if ((json)); then
      echo '{"running": false}'
    else
      echo "graphlane is not running (run dir $run_dir)"
    fi
    return 3
  fi
  bin=$(find_graphlane) || die "cannot ask for the status"
  if [[ -n $listen ]]; then
    connect=$(connect_endpoint "$listen")
  elif [[ -s $endpoint_file ]]; then
    connect=$(<"$endpoint_file")
  else
    connect=$(connect_endpoint "$(resolve_listen)")
  fi
  if ((json)); then
    "$bin" status --connect "$connect" --json
  else
    echo "graphlane running (pid $pid, run dir $run_dir, log $log_file)"
    "$bin" status --connect "$connect"
  fi
}

case $command in
  start) do_start ;;
  stop) do_stop ;;
  status)
    code=0
    do_status || code=$?
    exit "$code"
    ;;
  restart)
    do_stop
    exec 9>&-
    do_start
    ;;
esac
