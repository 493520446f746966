#!/usr/bin/env bash
# Installs the Debian packages shardport builds and tests with, only those
# that are missing, so a second run does nothing and prints nothing.
set -euo pipefail

packages=(
  meson ninja-build pkg-config gcc libc6-dev
  libuv1-dev libmsgpack-dev check libsystemd-dev libxxhash-dev libsodium-dev nettle-dev
  libmicrohttpd-dev python3-prometheus-client curl
  clang libclang-rt-14-dev valgrind
  systemd python3 python3-msgpack iproute2 procps
  python3-torch python3-numpy
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
  echo "shardport: missing packages: ${missing[*]} (run as root to install them)" >&2
  exit 1
fi
log=$(mktemp)
if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
  cat "$log" >&2
  rm -f "$log"
  echo "shardport: installing ${missing[*]} failed" >&2
  exit 1
fi
rm -f "$log"
