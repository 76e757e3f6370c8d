#!/bin/sh
# Every side-by-side benchmark with its defaults (about 10-15 minutes on a 2-core box), then one
# line per script: `<script> ratio=<its worst config>`. `make bench` runs this.
# compile_bench compiles the 1T preset for 6x8x64 (minutes); calibration.py and memory_vs_estimate.py
# are run on their own (bench/README.md).
set -e
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT
for script in compile_bench run_vs_eager dp_vs_ddp tp_vs_dtensor pp_vs_pipelining; do
    echo "== bench/$script.py"
    "$PY" "bench/$script.py" | tee "$LOGS/$script.log"
done
echo "== ratios (bench/README.md says what each compares)"
for script in compile_bench run_vs_eager dp_vs_ddp tp_vs_dtensor pp_vs_pipelining; do
    echo "$script $(grep '^ratio=' "$LOGS/$script.log" | tail -1)"
done
