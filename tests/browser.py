"""A real headless browser for the HTML report's test: Debian's chromium, driven over the
DevTools protocol on a pipe (``--remote-debugging-pipe``: JSON messages ended by a NUL byte on
file descriptors 3 and 4), so no websocket client nor downloaded browser is needed.

``chromium()`` finds the browser, installing Debian's package when it is missing and this is
a root Debian machine (``apt-get install chromium``, bounded in time); it says why when there is
none, so the test can skip with that reason. ``load(path)`` opens a local page with every host
name unresolvable and returns what the page did: console messages, uncaught exceptions, log
entries (failed loads among them), every request that is not to a local file, and a full-page
PNG screenshot.
"""
from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

NAMES = ("chromium", "chromium-browser")
INSTALL_SECONDS = 600


def chromium() -> tuple[str | None, str]:
    """(path of the browser or None, why there is none)."""
    found = next((p for p in map(shutil.which, NAMES) if p), None)
    if found:
        return found, ""
    if os.environ.get("SBPC_NO_BROWSER_INSTALL"):
        return None, "chromium is not installed and SBPC_NO_BROWSER_INSTALL is set"
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return None, "chromium is not installed, and installing it needs apt-get as root (apt-get install chromium)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]):
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_SECONDS, env=env)
            if proc.returncode != 0:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
                return None, f"`{' '.join(cmd)}` failed: {tail[0]}"
    except subprocess.TimeoutExpired:
        return None, f"installing chromium took over {INSTALL_SECONDS} s"
    found = next((p for p in map(shutil.which, NAMES) if p), None)
    return found, "" if found else "apt-get installed chromium but no chromium binary is on PATH"


@dataclass
class PageRun:
    console: list[str] = field(default_factory=list)  # console.* calls: "error: message"
    exceptions: list[str] = field(default_factory=list)  # uncaught exceptions
    log: list[str] = field(default_factory=list)  # browser log entries (a failed load, a blocked request)
    requests: list[str] = field(default_factory=list)  # URLs requested that are not the page's own file
    screenshot: bytes = b""
    size: tuple[int, int] = (0, 0)  # the page's content width and height in CSS px

    @property
    def problems(self) -> list[str]:
        return self.console + self.exceptions + self.log + [f"network request: {u}" for u in self.requests]


class _Pipe:
    def __init__(self, proc: subprocess.Popen, write_fd: int, read_fd: int):
        self.proc, self.w, self.r = proc, write_fd, read_fd
        self.buf = b""
        self.next_id = 0
        self.events: list[dict] = []

    def call(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30) -> dict:
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.w, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read(timeout)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == method for e in self.events):
            self.events.append(self._read(deadline - time.monotonic()))

    def drain(self, seconds: float) -> None:
        """Collect events for ``seconds`` more (late console messages)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.r], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return
            self.events.append(self._read(1))

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\0" not in self.buf:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.r], [], [], max(0.0, left))
            if not ready:
                raise TimeoutError("the browser did not answer in time")
            chunk = os.read(self.r, 1 << 20)
            if not chunk:
                raise RuntimeError(f"the browser exited (rc {self.proc.poll()})")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\0", 1)
        return json.loads(line)


def _high(fd: int) -> int:
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return moved


def load(browser: str, page: Path, width: int = 1280, timeout: float = 60) -> PageRun:
    """Open ``page`` (a local file) in ``browser`` and report what it did."""
    to_browser_r, to_browser_w = os.pipe()
    from_browser_r, from_browser_w = os.pipe()
    # the child's ends above 9, so that moving them to 3 and 4 overwrites neither
    to_browser_r, from_browser_w = (_high(fd) for fd in (to_browser_r, from_browser_w))
    profile = tempfile.mkdtemp(prefix="sbpc-chromium-")

    # the browser reads commands on fd 3 and writes replies on fd 4: bash puts the pipes there (dash
    # cannot name a descriptor above 9)
    shell = f'exec "$0" "$@" 3<&{to_browser_r} 4>&{from_browser_w} {to_browser_r}<&- {from_browser_w}>&-'
    argv = ["bash", "-c", shell, browser, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", "--hide-scrollbars",
            "--no-first-run", "--disable-extensions", "--disable-background-networking", "--disable-sync",
            f"--user-data-dir={profile}", "--host-resolver-rules=MAP * ~NOTFOUND", f"--window-size={width},800"]
    proc = subprocess.Popen(argv, pass_fds=(to_browser_r, from_browser_w),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(to_browser_r)
    os.close(from_browser_w)
    pipe = _Pipe(proc, to_browser_w, from_browser_r)
    try:
        target = pipe.call("Target.createTarget", {"url": "about:blank"}, timeout=timeout)["targetId"]
        session = pipe.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            pipe.call(f"{domain}.enable", session=session)
        pipe.events.clear()  # about:blank's
        pipe.call("Page.navigate", {"url": page.resolve().as_uri()}, session=session)
        pipe.wait_for("Page.loadEventFired", timeout)
        pipe.drain(0.5)
        metrics = pipe.call("Page.getLayoutMetrics", session=session)["cssContentSize"]
        w, h = int(metrics["width"]), int(metrics["height"])
        shot = pipe.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True,
                                                    "clip": {"x": 0, "y": 0, "width": w, "height": h, "scale": 1}},
                         session=session, timeout=timeout)
        run = PageRun(screenshot=base64.b64decode(shot["data"]), size=(w, h))
        own = page.resolve().as_uri()
        for e in pipe.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.consoleAPICalled":
                text = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
                run.console.append(f"{p.get('type')}: {text}")
            elif m == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                run.exceptions.append(d.get("exception", {}).get("description") or d.get("text", "exception"))
            elif m == "Log.entryAdded":
                entry = p.get("entry", {})
                run.log.append(f"{entry.get('level')}: {entry.get('text')} {entry.get('url', '')}".strip())
            elif m == "Network.requestWillBeSent":
                url = p.get("request", {}).get("url", "")
                if url != own and not url.startswith("data:"):
                    run.requests.append(url)
        try:
            pipe.call("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError):
            pass  # it is ending anyway
        return run
    finally:
        os.close(to_browser_w)
        os.close(from_browser_r)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)
