"""Where a run's start-up time goes: named phases, timed from the clock's origin.

    clock = StartupClock()
    with clock.phase("tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(path)
    clock.begin("engines"); clock.begin("learners")    # phases that overlap
    ...; clock.end("learners"); clock.end("engines")
    clock.seconds()   # {"tokenizer": 0.4, "engines": 6.1, "learners": 5.2}
    clock.summary()   # "started in 9.8 s: tokenizer 0.4, engines 6.1 | learners 5.2, ..."

``arbor train`` prints the summary once everything is up; ``scripts/profile_startup.py``
reads the same phases (and the time before them) to print a ``RESULT`` line.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class StartupClock:
    """Start and end offsets (seconds since ``origin``, a ``time.perf_counter()`` value) of phases."""

    def __init__(self, origin: float | None = None) -> None:
        self.origin = time.perf_counter() if origin is None else origin
        self.spans: dict[str, tuple[float, float | None]] = {}  # name -> (start, end or None while running)

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def begin(self, name: str) -> None:
        self.spans[name] = (self.now(), None)

    def end(self, name: str) -> None:
        start, _ = self.spans[name]
        self.spans[name] = (start, self.now())

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.begin(name)
        try:
            yield
        finally:
            self.end(name)

    def seconds(self) -> dict[str, float]:
        """Duration of each finished phase, in the order they began."""
        return {name: end - start for name, (start, end) in self.spans.items() if end is not None}

    def summary(self) -> str:
        """One line: the total, then each phase; phases that overlap the previous one are joined with ``|``."""
        text = ""
        last_end = 0.0
        for name, (start, end) in self.spans.items():
            if end is None:
                continue
            separator = "" if not text else " | " if start < last_end - 1e-3 else ", "
            text += f"{separator}{name} {end - start:.1f}"
            last_end = max(last_end, end)
        return f"started in {self.now():.1f} s: {text}"
