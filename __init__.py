"""sbpc: compile a single-device PyTorch training program into a distributed plan."""
__version__ = "0.1.0"


def shard(tensor, **axes):
    """Hint the SBP of ``tensor`` per mesh axis, e.g. ``sbpc.shard(w, tp="S(0)")``.

    On a parameter it fixes the parameter's layout; on an activation it pins that value's
    SBP (the residual stream ``tp="S(1)"`` is sequence parallelism). Outside ``sbpc compile``
    it returns ``tensor`` unchanged, so a model file stays plain PyTorch.
    """
    from sbpc.compiler.hints import ACTIVE

    recorder = ACTIVE.get()
    if recorder is None:
        return tensor
    import sys

    from sbpc.compiler.model_loader import display_path

    frame = sys._getframe(1)
    return recorder.shard(tensor, axes, f"{display_path(frame.f_code.co_filename)}:{frame.f_lineno}")
