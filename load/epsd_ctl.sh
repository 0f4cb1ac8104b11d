# Sourced by the load/ scripts: start and stop an epsd for a benchmark.
# Needs EPSD (the binary). epsd_start LISTEN [FLAGS...] sets EPSD_PID and
# EPSD_TARGET (the bound address: the port of 127.0.0.1:0 is filled in).

epsd_start() {
  local listen=$1
  shift
  EPSD_LISTEN=$listen
  EPSD_LOG=$(mktemp /tmp/eps-load-epsd-XXXXXX.log)
  # Metrics on an ephemeral port: served as in production, never a clash between runs.
  "$EPSD" --listen="$listen" --metrics-listen=127.0.0.1:0 "$@" 2>"$EPSD_LOG" &
  EPSD_PID=$!
  local i
  for i in $(seq 1 300); do
    EPSD_TARGET=$(sed -n 's/^epsd: listening on \([^ ]*\) .*/\1/p' "$EPSD_LOG")
    if [[ -n $EPSD_TARGET ]]; then
      # "listening" is printed once the server is up; the listen socket is bound by then.
      return 0
    fi
    if ! kill -0 "$EPSD_PID" 2>/dev/null; then
      echo "epsd did not start:" >&2
      cat "$EPSD_LOG" >&2
      return 1
    fi
    sleep 0.05
  done
  echo "epsd did not print its address within 15 s" >&2
  return 1
}

epsd_stop() {
  if [[ -n ${EPSD_PID:-} ]] && kill -0 "$EPSD_PID" 2>/dev/null; then
    kill -TERM "$EPSD_PID"
    wait "$EPSD_PID" 2>/dev/null || true
  fi
  EPSD_PID=
  rm -f "${EPSD_LOG:-}"
  # epsd keeps a unix socket's lock file (service/unix_socket.h); these scripts' sockets
  # are their own, so it goes with the epsd.
  if [[ ${EPSD_LISTEN:-} == unix://* ]]; then rm -f "${EPSD_LISTEN#unix://}.lock"; fi
}
