#!/bin/sh
# Installs the Debian packages the tests need beyond Python's: PostgreSQL's server (the
# control-plane tests start a throwaway one in a temp dir: tests/control/pg.py), bubblewrap
# (bwrap: the workloads' sandbox, gpucloud/control/sandbox/), util-linux's setpriv and
# slurm-wlm (the Slurm executor's tests run a one-node cluster on 127.0.0.1), chromium (the
# web console's browser tests drive it through Playwright: never a browser of its own),
# prometheus (promtool checks the shipped alert rules; a live one scrapes a control plane).
# Idempotent and quiet: does nothing when they are installed.
set -e
missing=""
ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || command -v pg_ctl >/dev/null 2>&1 \
    || missing="$missing postgresql"
command -v bwrap >/dev/null 2>&1 || missing="$missing bubblewrap"
command -v setpriv >/dev/null 2>&1 || missing="$missing util-linux"
command -v slurmctld >/dev/null 2>&1 || missing="$missing slurm-wlm"
test -x /usr/bin/chromium || missing="$missing chromium"
command -v promtool >/dev/null 2>&1 || missing="$missing prometheus"
[ -z "$missing" ] && exit 0
if [ "$(id -u)" = 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
else
    echo "missing$missing and this user cannot install it: their tests will skip or fail" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# shellcheck disable=SC2086
$SUDO apt-get install -y -qq $missing >/dev/null
