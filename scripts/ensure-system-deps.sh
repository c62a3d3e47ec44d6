#!/usr/bin/env bash
# Makes sure the system programs the tests drive are on PATH: prometheus and promtool
# (Debian package `prometheus`) and openssl (TLS certificates). `make test` runs it first.
#
#   all present                  -> exit 0, nothing else happens
#   missing, apt-get, root       -> apt-get installs the missing packages
#   missing, otherwise           -> exit 1 at once, with the command to run
#
# Uses only bash builtins, `id` and `apt-get`, so a test can run it with a PATH that
# holds stand-ins for them.
set -euo pipefail

fail() {
  printf '%s\n' "$@" >&2
  exit 1
}

programs_missing() {
  local program
  for program in prometheus promtool openssl; do
    command -v "$program" >/dev/null 2>&1 || printf '%s ' "$program"
  done
}

packages_for() {
  # prometheus and promtool both come from the Debian package `prometheus`.
  local missing=" $1" packages=()
  if [[ $missing == *" prometheus "* || $missing == *" promtool "* ]]; then
    packages+=(prometheus)
  fi
  if [[ $missing == *" openssl "* ]]; then
    packages+=(openssl)
  fi
  printf '%s' "${packages[*]}"
}

missing=$(programs_missing)
if [[ -z $missing ]]; then
  exit 0
fi
packages=$(packages_for "$missing")
install_command="apt-get install -y -q --no-install-recommends $packages"

if ! command -v apt-get >/dev/null 2>&1; then
  fail "The tests drive these programs, which are not on PATH: ${missing% }." \
    "This machine has no apt-get. Install them, then run make test again:" \
    "  on Debian or Ubuntu:  sudo apt-get update && sudo $install_command" \
    "  elsewhere: prometheus and promtool from https://prometheus.io/download/, and" \
    "             openssl from the system's package manager"
fi

if [[ $(id -u) != 0 ]]; then
  fail "The tests drive these programs, which are not on PATH: ${missing% }." \
    "Installing them needs root. Run this, then make test again:" \
    "  sudo apt-get update && sudo $install_command"
fi

echo "Installing what the tests drive (${missing% }): apt-get install $packages" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# shellcheck disable=SC2086 # $packages is a list of package names
apt-get install -y -q --no-install-recommends $packages

still_missing=$(programs_missing)
if [[ -n $still_missing ]]; then
  fail "apt-get installed $packages, but ${still_missing% } is still not on PATH."
fi
