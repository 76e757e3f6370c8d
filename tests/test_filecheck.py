"""Unit tests of the tiny FileCheck in tests/filecheck.py."""
import re

import pytest

from filecheck import filecheck

TEXT = """\
graph @g mesh<dp=2> {
  %a = aten.mm.default(%x, %w) : f32[4, 8] {role=fwd}
  %b = aten.relu.default(%a) : f32[4, 8] {role=fwd}
  %c = aten.relu.default(%b) : f32[4, 8] {role=bwd}
  output loss %c "loss"
}
"""


def fails(checks: str, *patterns: str) -> str:
    with pytest.raises(AssertionError) as err:
        filecheck(TEXT, checks)
    message = str(err.value)
    for p in patterns:
        assert re.search(p, message), f"{p!r} not in:\n{message}"
    return message


def test_check_passes_in_order():
    filecheck(TEXT, "CHECK: graph @g\nCHECK: aten.mm.default\nCHECK: output loss")


def test_check_fails_out_of_order_and_shows_region():
    fails("CHECK: output loss\nCHECK: aten.mm.default",
          r"checks line 2: CHECK: aten.mm.default", r"no match", r"line 5, column 14",
          r"5 \| +output loss", r"6 \| \}")


def test_check_may_match_later_on_the_same_line():
    filecheck(TEXT, "CHECK: %a =\nCHECK: f32[4, 8]")


def test_check_next_passes():
    filecheck(TEXT, "CHECK: %a = \nCHECK-NEXT: %b = \nCHECK-NEXT: %c =")


def test_check_next_fails_when_match_is_further_down():
    fails("CHECK: %a = \nCHECK-NEXT: %c = ", r"CHECK-NEXT: %c =", r"no match", r"3 \| .*%b = ")


def test_check_next_fails_at_the_last_line():
    with pytest.raises(AssertionError, match="no next line"):
        filecheck("one line", "CHECK: one\nCHECK-NEXT: two")


def test_check_next_needs_a_previous_match():
    with pytest.raises(ValueError, match="needs a match before it"):
        filecheck(TEXT, "CHECK-NEXT: graph")


def test_check_same_passes():
    filecheck(TEXT, "CHECK: %b = aten.relu\nCHECK-SAME: f32[4, 8]\nCHECK-SAME: {role=fwd}")


def test_check_same_fails_when_on_another_line():
    fails("CHECK: %b = aten.relu\nCHECK-SAME: role=bwd", r"CHECK-SAME: role=bwd", r"3 \| .*%b = aten.relu")


def test_check_same_fails_before_the_previous_match():
    fails("CHECK: f32[4, 8]\nCHECK-SAME: %a", r"CHECK-SAME: %a", r"no match")


def test_check_not_passes_between_matches():
    filecheck(TEXT, "CHECK: %a =\nCHECK-NOT: role=bwd\nCHECK: %b =")


def test_check_not_fails_between_matches():
    fails("CHECK: %a =\nCHECK-NOT: relu\nCHECK: %c =",
          r"CHECK-NOT: relu", r"found 'relu' on line 3", r"2 \| ", r"4 \| ")


def test_check_not_at_the_end_covers_the_rest():
    filecheck(TEXT, "CHECK: output\nCHECK-NOT: aten")
    fails("CHECK: %b =\nCHECK-NOT: bwd", r"found 'bwd' on line 4")


def test_check_not_at_the_start_covers_up_to_first_match():
    filecheck(TEXT, "CHECK-NOT: output\nCHECK: %c =")
    fails("CHECK-NOT: relu\nCHECK: output", r"found 'relu' on line 3")


def test_check_count_passes():
    filecheck(TEXT, "CHECK-COUNT-2: aten.relu.default\nCHECK-NOT: aten.relu")
    filecheck(TEXT, "CHECK-COUNT-3: {{%[a-c]}} = ")


def test_check_count_fails_when_too_few():
    fails("CHECK-COUNT-3: aten.relu.default", r"CHECK-COUNT-3: aten.relu.default", r"no match")


def test_check_count_with_not_catches_too_many():
    fails("CHECK-COUNT-1: aten.relu.default\nCHECK-NOT: aten.relu.default", r"found .* on line 4")


def test_regex_spans():
    filecheck(TEXT, "CHECK: %{{[a-z]+}} = aten.{{mm|bmm}}.default(%x, %w)")
    fails("CHECK: f32[{{[0-9]+}}, 9]", r"no match")


def test_literal_metacharacters_are_literal():
    filecheck("a.b(c)*", "CHECK: a.b(c)*")
    with pytest.raises(AssertionError):
        filecheck("axb(c)", "CHECK: a.b(c)")


def test_malformed_checks():
    with pytest.raises(ValueError, match="no CHECK directives"):
        filecheck(TEXT, "nothing here")
    with pytest.raises(ValueError, match="empty pattern"):
        filecheck(TEXT, "CHECK:   ")
    with pytest.raises(ValueError, match="bad regex"):
        filecheck(TEXT, "CHECK: {{[}}")


def test_long_region_is_truncated():
    text = "\n".join(f"line {i}" for i in range(100))
    message = fails_on(text, "CHECK: missing")
    assert "more lines" in message and "line 50" not in message


def fails_on(text: str, checks: str) -> str:
    with pytest.raises(AssertionError) as err:
        filecheck(text, checks)
    return str(err.value)
