#!/bin/sh
# Both benchmarks with their defaults (about 4-5 minutes on a 2-core box).
# `make bench` runs the same: .venv/bin/python bench/compile_bench.py && .venv/bin/python bench/run_vs_eager.py
set -e
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" bench/compile_bench.py "$@"
"$PY" bench/run_vs_eager.py
