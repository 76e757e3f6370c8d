"""sbpc: compile a single-device PyTorch training program into a distributed plan."""
__version__ = "0.1.0"


def shard(tensor, **axes):
    """Hint the SBP of ``tensor`` per mesh axis, e.g. ``sbpc.shard(w, tp="S(0)")``.

    On a parameter it fixes the parameter's layout; on an activation it pins that value's
    SBP (the residual stream ``tp="S(1)"`` is sequence parallelism). Outside ``sbpc compile``
    it returns ``tensor`` unchanged, so a model file stays plain PyTorch.
    """
    from sbpc.compiler.frontend.hints import ACTIVE

    recorder = ACTIVE.get()
    if recorder is None:
        return tensor
    import sys

    from sbpc.compiler.frontend.model_loader import display_path

    frame = sys._getframe(1)
    return recorder.shard(tensor, axes, f"{display_path(frame.f_code.co_filename)}:{frame.f_lineno}")


def stage(index: int):
    """``with sbpc.stage(1): ...`` puts the forward ops traced inside on pipeline chunk 1.

    Chunks count from 0 to ``pp * virtual_stages - 1``; backward and optimizer ops follow
    their forward op and parameter, and ops outside every scope are placed by the
    partitioner. Outside ``sbpc compile`` (and on a mesh without pp) it does nothing, so a
    model file stays plain PyTorch (fallback: ``contextlib.nullcontext()``).
    """
    import contextlib

    from sbpc.compiler.frontend.hints import ACTIVE

    recorder = ACTIVE.get()
    if recorder is None:
        return contextlib.nullcontext()
    import sys

    from sbpc.compiler.frontend.model_loader import display_path

    frame = sys._getframe(1)
    return recorder.stage(index, f"{display_path(frame.f_code.co_filename)}:{frame.f_lineno}")
