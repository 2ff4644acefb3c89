# Sourced by the scripts that measure against their own redis-server (bench, script-cost,
# redis-key-floor): one way to start it and to know it is up.
#
#   start_redis PORT [CPU]   starts redis-server on 127.0.0.1:PORT without persistence, pinned to
#                            CPU when given; sets redis_pid; exits the script if it does not answer.
#                            The caller stops it (its EXIT trap kills "$redis_pid").
start_redis() {
  local port=$1 cpu=${2:-}
  local pin=()
  [ -z "$cpu" ] || pin=(taskset -c "$cpu")
  "${pin[@]}" redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no >/dev/null 2>&1 &
  redis_pid=$!
  for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "$(basename "$0"): redis-server did not start on port $port" >&2
  exit 1
}
