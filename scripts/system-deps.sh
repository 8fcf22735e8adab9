#!/usr/bin/env bash
# Debian packages the tests use as real parts: Prometheus + promtool and Alertmanager (rules,
# dashboard queries, alert delivery), Chromium (pages, HTML report), docker-compose (validates
# docker-compose.yml; no container engine needed) and a C compiler with the Python headers (the
# reference pool's compiled build). Installs only what is missing; needs root and
# apt-get (as on the project's machines and in CI).
set -euo pipefail
need=()
command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v prometheus-alertmanager >/dev/null 2>&1 || need+=(prometheus-alertmanager)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
# The C compiler and Python headers mypyc's extension modules build with (make native).
command -v cc >/dev/null 2>&1 || need+=(gcc)
include=$("${PYTHON:-python3}" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
[ -f "$include/Python.h" ] || need+=(python3-dev)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
  echo "system-deps: missing ${need[*]}; install them with your package manager (needs root + apt-get here)" >&2
  exit 1
fi
echo "system-deps: installing ${need[*]}" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
