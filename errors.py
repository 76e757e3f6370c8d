"""The one error hierarchy of sbpc.

Every user-facing failure is an ``SbpcError``: it names the culprit, where it came from in
the user's code when known, and a hint. The CLI prints ``str(err)`` on one line and exits 2.
``runtime`` and ``compiler`` both import from here, so a cluster node needs only this file.
"""
from __future__ import annotations


class SbpcError(Exception):
    """Base of every error sbpc reports to a user."""

    kind = "error"

    def __init__(self, message: str, *, hint: str | None = None, location: str | None = None,
                 detail: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.location = location
        self.detail = detail  # multi-line context (a source excerpt with a caret); shown with --debug

    def __str__(self) -> str:
        text = self.message
        if self.location:
            text += f" (at {self.location})"
        if self.hint:
            text += f"; hint: {self.hint}"
        return " ".join(text.split())  # one line, always


class UsageError(SbpcError):
    """Bad command-line input: a flag, a --set value, a mesh string."""


class ModelError(SbpcError):
    """The model file cannot be loaded or does not follow the model contract."""


class CaptureError(SbpcError):
    """The model could not be traced into a graph."""


class IRError(SbpcError):
    """The IR failed verification or could not be parsed."""


class PassBug(Exception):
    """A pass produced IR that fails verification: a bug in sbpc, whatever the input, so not an
    ``SbpcError`` (the CLI reports it as an internal error, exit 3). The verifier's ``IRError``
    is its cause."""


class CompileError(SbpcError):
    """A pass could not produce a valid plan."""


class PlanError(SbpcError):
    """A plan file is missing, corrupt, or from another schema version."""


class OutputError(SbpcError):
    """A file or directory sbpc was asked to write cannot be written."""


class RuntimeFailure(SbpcError):
    """Executing a plan failed; the message names the instruction and the user's line."""


class WeightsError(SbpcError):
    """A weights file is missing, unreadable, or does not match the plan's parameters."""


class DataError(SbpcError):
    """A training data file is missing, empty, of the wrong dtype, or holds token ids the model's
    vocabulary does not have."""


class CheckpointError(SbpcError):
    """A checkpoint directory is missing, incomplete, corrupt, of another schema version, or
    does not match the plan it is resumed into."""


def guarded_main(body, argv_debug: bool, prog: str = "sbpc") -> int:
    """Run a CLI body: an SbpcError ends in one line and exit 2; --debug shows the traceback."""
    import os
    import sys
    import traceback

    try:
        return body() or 0
    except SbpcError as err:
        if argv_debug:
            traceback.print_exc()
            if err.detail:
                print(err.detail, file=sys.stderr)
        print(f"{prog}: {err.kind}: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `sbpc inspect plan.json | head` closed the pipe: not an error
        sys.stdout = open(os.devnull, "w")
        return 0
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # a bug in sbpc, not in the user's input
        if argv_debug:
            traceback.print_exc()
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        print(f"{prog}: internal error: {type(err).__name__}: {first}; hint: rerun with --debug and report the trace",
              file=sys.stderr)
        return 3

