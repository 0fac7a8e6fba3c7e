"""Peak memory of a process tree, sampled while a benchmark side runs."""

from __future__ import annotations

import threading
import time

import psutil


class PeakRSS:
    """Peak summed RSS (bytes) of a process and all its descendants, sampled in a thread."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        self.root = psutil.Process(pid)
        self.every_s = every_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        total = 0
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        for proc in procs:
            try:
                total += proc.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            time.sleep(self.every_s)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
