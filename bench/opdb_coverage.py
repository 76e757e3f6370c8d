"""The whole op-database sweep: every signature of every rule on every op_db sample.

Walks torch's OpInfo database (cpu, float32), records the ATen calls of each sample forward
and backward, and checks every signature the rule book offers for each call on simulated
axes of 2 and 3 devices (compiler/sbp/rules/sweep.py). Prints any failure, the coverage
table, and last a line ``ratio=<overloads validated by the sweep / overloads DTensor
registers>``. Exit status 1 when a signature fails. About 10 minutes on a 2-core box.

    .venv/bin/python bench/opdb_coverage.py
"""
from __future__ import annotations

import sys
import time

from sbpc.compiler.sbp.rules import RuleBook
from sbpc.compiler.sbp.rules.sweep import coverage, opinfos, sweep


def main() -> int:
    start = time.time()
    book = RuleBook.load()
    infos = opinfos("all")
    result = sweep(book, infos)
    for f in result.failures:
        print("FAIL", f)
    cov = coverage(book, result)
    print(f"{len(infos)} OpInfos, {result.samples} samples, {len(result.outcomes)} signatures checked, "
          f"{len(result.failures)} failed, {time.time() - start:.0f} s")
    print(cov.table())
    print(f"validated / DTensor's functional overloads: {cov.validated / cov.dtensor_functional:.3f}")
    print(f"ratio={cov.validated / cov.dtensor:.3f}")
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
