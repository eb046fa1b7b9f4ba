"""Child processes that neither a Ctrl-C nor a kill leaves behind, for sweeps
(:mod:`.sweep`) and replica runs (:mod:`.replicas`).

Each child is a Python process that leads a process group of its own from before it runs
a line, so a Ctrl-C at the terminal, which signals the whole foreground group, reaches
the parent alone: no child prints a ``KeyboardInterrupt`` traceback. While
:class:`Children` is entered, the parent notes SIGINT and SIGTERM instead of dying, wakes
from its wait on the children's output, and on leaving stops every child by signalling
its group (what the child started, compiler processes included). A child whose parent
dies without doing so (``kill -9``) notices within a second and ends its group
(:func:`end_with_parent`).
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(Exception):
    """A run that SIGINT or SIGTERM stopped, its children ended."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


@contextmanager
def stopping_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`Stopped` in the block (work in this process, which
    has no children to stop first; :class:`Children` inside it notes them instead)."""

    def stop(signum: int, frame) -> None:
        raise Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class Child:
    """``python -m MODULE ARGS... PARENT_PID`` leading a process group of its own, its
    stdout and stderr piped, its stdin too unless ``stdin`` says otherwise; a warning made
    an error here (``python -W error ...``) is one in the child too."""

    def __init__(self, module: str, *args: str, stdin: int | None = subprocess.PIPE):
        flags = [f"-W{w}" for w in sys.warnoptions]
        self.proc = subprocess.Popen(
            [sys.executable, *flags, "-m", module, *args, str(os.getpid())],
            stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, process_group=0,
        )  # fmt: skip
        self.partial = {self.proc.stdout.fileno(): b"", self.proc.stderr.fileno(): b""}

    def lines(self, fd: int, chunk: bytes) -> list[str]:
        """The whole lines that ``chunk`` completes on stream ``fd``."""
        *whole, self.partial[fd] = (self.partial[fd] + chunk).split(b"\n")
        return [line.decode(errors="replace") for line in whole]

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:  # the whole group has exited
            pass

    def close(self) -> int:
        """Wait for the child to end; its exit status."""
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                if stream is not None:
                    stream.close()
            except BrokenPipeError:  # stdin, holding what the child died before reading
                pass
        return self.proc.wait()


class Children:
    """The children of a ``with`` block, their output read through one selector, and
    SIGINT and SIGTERM noted rather than acted on (``stopped``: the first one).

    Leaving the block stops every child not yet closed (SIGTERM to its group, SIGKILL
    after ``grace`` seconds), then puts the signal handlers back.
    """

    def __init__(self, grace: float = 10.0):
        self.grace = grace
        self.live: list[Child] = []
        self.signals: list[int] = []

    def __enter__(self) -> Children:
        self._selector = selectors.DefaultSelector()
        # The handler only takes note, and wakes read() through a pipe: stopping in the
        # middle of starting a child could leave one running that nothing knows of.
        self._wake_r, self._wake_w = os.pipe()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._previous = {s: signal.signal(s, self._note) for s in STOP_SIGNALS}
        return self

    def _note(self, signum: int, frame) -> None:
        self.signals.append(signum)
        os.write(self._wake_w, b"!")

    @property
    def stopped(self) -> int | None:
        return self.signals[0] if self.signals else None

    def add(self, child: Child) -> Child:
        """Read ``child``'s stdout and stderr, and stop it on leaving the block."""
        self.live.append(child)
        for stream in (child.proc.stdout, child.proc.stderr):
            self._selector.register(stream, selectors.EVENT_READ, child)
        return child

    def read(self, timeout: float) -> Iterator[tuple[Child, int, bytes]]:
        """Wait up to ``timeout`` seconds for output; then (child, fd, chunk) for each
        stream ready, ``b""`` where one has ended (it is not read again). Nothing on a
        timeout, or when a stop signal came."""
        for key, _ in self._selector.select(timeout=timeout):
            chunk = os.read(key.fd, 1 << 16)
            if key.data is None:  # a stop signal
                continue
            if not chunk:  # unregistered as it is handed over, so reading() says if it was the last
                self._selector.unregister(key.fileobj)
            yield key.data, key.fd, chunk

    def reading(self, child: Child) -> bool:
        """Whether one of ``child``'s streams is still open: it has not ended."""
        return any(k.data is child for k in self._selector.get_map().values())

    def close(self, child: Child) -> int:
        """Wait for ``child``, which has ended or is ending; its exit status."""
        self.live.remove(child)
        return child.close()

    def __exit__(self, *exc) -> None:
        for child in self.live:
            child.signal_group(signal.SIGTERM)
        for child in self.live:
            try:
                child.proc.wait(timeout=self.grace)
            except subprocess.TimeoutExpired:
                child.signal_group(signal.SIGKILL)
            child.close()
        self.live.clear()
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def how_it_ended(code: int) -> str:
    """A child's exit status in words: "exited with status 1", "killed by SIGKILL"."""
    if code < 0:
        name = signal.Signals(-code).name
        return f"killed by {name}" + (" (out of memory?)" if -code == signal.SIGKILL else "")
    return f"exited with status {code}"


def end_with_parent(parent: int) -> None:
    """In a child: end this process group once ``parent`` is no longer this process's
    parent (it died without stopping it), checked every second from a daemon thread."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()
