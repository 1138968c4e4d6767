#!/usr/bin/env bash
# Install Debian/Ubuntu packages with apt-get unless they are already there.
#
#     tools/install_system.sh PKG...        (the Makefile's `make install-system` runs it)
#
# A package counts as present when a command of its name is on PATH (redis-server, chromium,
# python3) or dpkg lists it as installed (python3-venv); present ones are skipped. The rest are
# installed in one `apt-get install --no-install-recommends` after `apt-get update`, as root or
# through passwordless sudo. Without either it installs nothing and exits 1 with the command to run.
set -euo pipefail

say() { echo "[install-system] $*"; }

present() {
  command -v "$1" >/dev/null 2>&1 && return 0
  [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null || true)" = "install ok installed" ]
}

missing=()
for pkg in "$@"; do
  if present "$pkg"; then
    say "$pkg: present ($(command -v "$pkg" 2>/dev/null || echo "dpkg: installed"))"
  else
    missing+=("$pkg")
  fi
done
[ "${#missing[@]}" -eq 0 ] && exit 0

cmd="apt-get update && apt-get install -y --no-install-recommends ${missing[*]}"
if ! command -v apt-get >/dev/null 2>&1; then
  say "missing: ${missing[*]}, and this machine has no apt-get (kvroute's Makefile installs system"
  say "packages on Debian/Ubuntu only). Install them with this system's package manager, then rerun."
  exit 1
fi
if [ "$(id -u)" -eq 0 ]; then
  SUDO=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  SUDO=(sudo -n)
else
  say "missing: ${missing[*]}; installing them needs root or passwordless sudo, which user $(id -un) does not have."
  say "Run this once (as root, or with sudo and your password), then run make again:"
  say "    sudo sh -c '$cmd'"
  exit 1
fi

say "installing with apt-get: ${missing[*]}"
"${SUDO[@]}" apt-get update -q
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
  -o Dpkg::Use-Pty=0 "${missing[@]}"

for pkg in "${missing[@]}"; do
  if ! present "$pkg"; then
    say "$pkg: still missing after apt-get install; run: sudo sh -c '$cmd'"
    exit 1
  fi
  say "$pkg: installed ($(command -v "$pkg" 2>/dev/null || echo "dpkg: installed"))"
done
