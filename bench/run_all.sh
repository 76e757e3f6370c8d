#!/bin/sh
# All benchmarks with their defaults (about 6-9 minutes on a 2-core box).
# `make bench` runs the first two: .venv/bin/python bench/compile_bench.py && .venv/bin/python bench/run_vs_eager.py
# The last two spawn 2 ranks over gloo: the plan on mesh 2x1 vs torch DDP, and on mesh 1x2 vs DTensor TP.
set -e
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" bench/compile_bench.py "$@"
"$PY" bench/run_vs_eager.py
"$PY" bench/dp_vs_ddp.py
"$PY" bench/tp_vs_dtensor.py
"$PY" bench/pp_vs_pipelining.py
