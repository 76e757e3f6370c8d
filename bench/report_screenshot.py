"""The HTML report of a pipelined 3-D plan as a person sees it: compile the tiny GPT on
``2x2x2`` (dp x tp x pp, Megatron hints, 4 micro-batches), write ``sbpc report``, open it in
headless chromium (tests/browser.py: no console message, no request) and save a full-page
screenshot.

    .venv/bin/python bench/report_screenshot.py            # -> bench/report_screenshot.png
    .venv/bin/python bench/report_screenshot.py --out x.png
"""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPILE = ["examples/gpt.py", "--mesh", "2x2x2", "--microbatches", "4", "--config", "examples/gpt.megatron.toml"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "report_screenshot.png"))
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))  # the browser driver of the report's test
    import browser
    from sbpc.cli import main as sbpc

    path, why = browser.chromium()
    if path is None:
        print(f"no headless browser: {why}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as d, contextlib.redirect_stdout(io.StringIO()):
        plan, page = f"{d}/plan.json", Path(d) / "report.html"
        if sbpc(["compile", *COMPILE, "-o", plan]) or sbpc(["report", plan, "-o", str(page)]):
            return 1
        run = browser.load(path, page)
    Path(args.out).write_bytes(run.screenshot)
    print(f"sbpc report of sbpc compile {' '.join(COMPILE)}: {run.size[0]}x{run.size[1]} px -> {args.out}; "
          f"problems: {run.problems or 'none'}")
    return 1 if run.problems else 0


if __name__ == "__main__":
    sys.exit(main())
