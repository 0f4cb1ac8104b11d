#!/bin/sh
# Starts epsd with the flags in $EPSD_FLAGS_FILE (default /etc/epsd/epsd.flags:
# one --flag=value a line, '#' starts a comment, values hold no spaces, LF or
# CRLF line ends) and then the container's own arguments, which therefore
# override the file (epsd keeps the last value of a flag). EPSD_FLAGS_FILE=
# (empty) reads no file.
set -eu
EPSD_BIN=${EPSD_BIN:-/usr/local/bin/epsd}
EPSD_FLAGS_FILE=${EPSD_FLAGS_FILE-/etc/epsd/epsd.flags}

# Raise the soft open-file limit to the hard one: epsd holds a descriptor per
# client connection, idle ones included, and container runtimes often start
# processes at a soft limit of 1024 (docs/deploy-operations.md, "File descriptors"). Where
# the limit cannot be raised, epsd starts with the one it was given. (-n is not
# POSIX; dash, the image's /bin/sh, has it.)
# shellcheck disable=SC3045
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

flags=""
if [ -n "$EPSD_FLAGS_FILE" ]; then
  # A regular file: reading a directory fails inside the loop below, which would
  # then start epsd without the flags, silently.
  if [ ! -f "$EPSD_FLAGS_FILE" ] || [ ! -r "$EPSD_FLAGS_FILE" ]; then
    echo "epsd-entrypoint: cannot read flags file $EPSD_FLAGS_FILE (EPSD_FLAGS_FILE must name a readable regular file)" >&2
    exit 2
  fi
  # A file saved with CRLF line ends (an editor on Windows) would hand epsd
  # values ending in a carriage return: "--backend=cpu\r: want one of ...".
  cr=$(printf '\r')
  while IFS= read -r line || [ -n "$line" ]; do
    line=${line%"$cr"}
    flags="$flags ${line%%#*}"
  done <"$EPSD_FLAGS_FILE"
fi

# Split the flags on whitespace, with globbing off so that no value expands.
set -f
# shellcheck disable=SC2086
exec "$EPSD_BIN" $flags "$@"
