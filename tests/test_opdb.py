"""The rule book proven on torch's OpInfo database, as DTensor proves its strategies.

Every ATen call of every sample (forward and backward) of the OpInfos swept, where the call's
op has a non-trivial rule, is checked under every signature the rule book offers, by
execution on simulated axes of 2 and 3 devices (compiler/sbp/rules/sweep.py). The default
test sweeps a fixed fifth of op_db (chosen by a hash of the name) with up to 4 samples each;
the ``slow`` test and bench/opdb_coverage.py sweep all of it.
"""
from __future__ import annotations

import pytest

pytest.importorskip("expecttest")  # torch.testing._internal needs it (a test dependency)

from sbpc.compiler.sbp.rules import RuleBook  # noqa: E402
from sbpc.compiler.sbp.rules.sweep import coverage, opinfos, sweep  # noqa: E402


@pytest.fixture(scope="module")
def book():
    return RuleBook.load()


def _fail_on(result):
    if result.failures:
        pytest.fail(f"{len(result.failures)} of {len(result.outcomes)} signatures fail "
                    "(op (OpInfo sample call) k=devices signature: why):\n" + "\n".join(result.failures[:30]))


def test_ci_subset_of_op_db(book):
    result = sweep(book, opinfos("ci"), max_samples=4)
    _fail_on(result)
    # the subset exercises real rules, not only all-B: a sweep that checks nothing cannot pass
    assert len(result.validated()) >= 80, sorted(result.validated())
    print("\n" + coverage(book, result).table())


def test_a_wrong_rule_fails_the_sweep():
    wrong = RuleBook.from_text("aten.exp.default = elementwise(self) partial(self)\n"
                               'aten.sum.dim_IntList = reduce(self, dim, keepdim, "max")')
    result = sweep(wrong, [o for o in opinfos("all") if o.name in ("exp", "sum")])
    assert any(f.startswith("aten.exp.default (exp sample") and "(P) -> (P)" in f for f in result.failures)
    assert any(f.startswith("aten.sum.dim_IntList") and "P(max)" in f for f in result.failures)


@pytest.mark.sweep
def test_whole_op_db(book):
    result = sweep(book, opinfos("all"))
    _fail_on(result)
    cov = coverage(book, result)
    print("\n" + cov.table() + f"\nratio={cov.validated / cov.dtensor:.3f}")
