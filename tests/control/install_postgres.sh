#!/bin/sh
# Installs Debian's PostgreSQL server for the control-plane tests (tests/control/pg.py starts
# a throwaway one in a temp dir). Idempotent: does nothing when a server is installed.
set -e
if ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || command -v pg_ctl >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" = 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
else
    echo "PostgreSQL is not installed and this user cannot install it: its tests will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq postgresql >/dev/null
