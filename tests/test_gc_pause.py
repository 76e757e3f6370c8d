"""The cyclic collector's pause around a compile (compiler/gc_pause.py), and who skips the walk after it."""
import gc
import weakref

from sbpc import cli
from sbpc.compiler.gc_pause import no_cycle_collection


class _Cell:
    pass


def _cycle() -> weakref.ref:
    """A two-object reference cycle nothing else holds; the weak reference dies once it is collected."""
    a, b = _Cell(), _Cell()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_pause_leaves_its_objects_to_the_next_young_collection():
    """A library compile (tests, `sbpc search`): the pause's cycles are young objects after it,
    freed by the next collection of the youngest generation."""
    assert gc.isenabled()
    with no_cycle_collection():
        assert not gc.isenabled()
        dead = _cycle()
        gc.collect(0)  # an explicit collection still runs; the pause only stops the automatic ones
        assert dead() is None
        alive = _cycle()
    assert gc.isenabled() and alive() is not None
    gc.collect(0)
    assert alive() is None


def test_pause_before_exit_moves_its_objects_out_of_the_young_generations():
    """`sbpc compile` from a shell: what the compile made is put in the oldest generation, so no
    young collection walks it; a full collection still frees its cycles."""
    with no_cycle_collection(collect_after=False):
        kept = _cycle()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.collect(1)
    assert kept() is not None
    gc.collect()
    assert kept() is None


def test_nested_pause_leaves_the_collector_as_it_found_it():
    with no_cycle_collection():
        with no_cycle_collection(collect_after=False):
            inner = _cycle()
        assert not gc.isenabled()  # the outer pause still holds
    assert gc.isenabled()
    gc.collect(0)  # the inner pause moved nothing: it did not turn the collector back on
    assert inner() is None


def test_only_the_console_script_says_the_process_exits(tmp_path):
    """console_main runs a quick-exit command with ``exits=True``; ``main`` (tests, other
    programs) never does, so its compiles collect their cycles."""
    out = str(tmp_path / "p.json")
    args, code = cli._run(["compile", "examples/mlp.py", "--mesh", "2", "-o", out], exits=True)
    assert code == 0 and args.process_exits
    args, code = cli._run(["compile", "examples/mlp.py", "--mesh", "2", "-o", out])
    assert code == 0 and not args.process_exits
