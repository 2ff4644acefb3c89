# Sourced by the scripts that measure against their own redis-server (bench, cluster-bench,
# script-cost, redis-key-floor): one way to start it and to know it is up, and what they read of
# it and of sluice.
#
#   start_redis PORT [CPU [FLAG...]]   starts redis-server on 127.0.0.1:PORT without persistence,
#                            pinned to CPU when given (an empty CPU: not pinned), with any further
#                            redis-server flags; sets redis_pid; exits the script if it does not
#                            answer. The caller stops it (its EXIT trap kills "$redis_pid").
#   redis_cpu PORT...        the servers' process CPU so far, in seconds (INFO's used_cpu_sys +
#                            used_cpu_user, summed)
#   redis_fcalls PORT...     the limiter's calls (FCALL) the servers have run so far (INFO
#                            commandstats, summed)
#   sluice_calls HTTP_PORT   the ShouldRateLimit calls sluice has answered so far (its metrics)
start_redis() {
  local port=$1 cpu=${2:-}
  shift $(($# < 2 ? $# : 2))
  local pin=()
  [ -z "$cpu" ] || pin=(taskset -c "$cpu")
  "${pin[@]}" redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no "$@" >/dev/null 2>&1 &
  redis_pid=$!
  for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "$(basename "$0"): redis-server did not start on port $port" >&2
  exit 1
}

redis_cpu() {
  local port
  for port in "$@"; do redis-cli -p "$port" info cpu; done | tr -d '\r' |
    awk -F: '/^used_cpu_(sys|user):/ {s += $2} END {printf "%.6f", s}'
}

redis_fcalls() {
  local port
  for port in "$@"; do redis-cli -p "$port" info commandstats; done | tr -d '\r' |
    awk -F'[=,]' '/^cmdstat_fcall:/ {s += $2} END {printf "%d", s}'
}

sluice_calls() {
  curl -s "http://127.0.0.1:$1/metrics" |
    awk '/^sluice_should_rate_limit_total/ {s += $2} END {printf "%d", s}'
}
