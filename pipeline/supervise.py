"""Supervised worker threads: a worker that raises is restarted with backoff.

Policy (one for every long-running worker of the service: ingest, scheduler,
reconcile, canary): the worker runs ``target(stop)`` on a daemon thread until ``stop``
is set. If it raises, the error is logged with its traceback, counted in
``hourglass_worker_restarts_total{worker}``, and the worker is started again
after an exponential backoff (``initial_s`` doubling to ``max_s``, tenacity's
``wait_exponential``). A worker that ran for ``healthy_after_s`` before it
failed starts over at ``initial_s``. While it waits, :meth:`Worker.state` says
``restarting`` and ``/readyz`` reports it not ready; the process itself stays
up (the ops API keeps answering), so one bad dependency does not take down the
others.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import cast

from prometheus_client import Counter, Gauge
from tenacity import RetryCallState, wait_exponential

log = logging.getLogger(__name__)

WORKER_RESTARTS = Counter("hourglass_worker_restarts", "Restarts of a service worker after it raised.", ["worker"])
WORKER_UP = Gauge(
    "hourglass_worker_up", "1 while a service worker runs, 0 while it is stopped or waits to restart.", ["worker"]
)


def attempt_state(number: int) -> RetryCallState:
    """What tenacity's ``wait_exponential`` reads of a call state: only ``attempt_number`` (1-based)."""
    return cast(RetryCallState, SimpleNamespace(attempt_number=number))


@dataclass(frozen=True)
class WorkerState:
    """What ``/status`` shows for one worker (JSON-ready via :meth:`as_dict`)."""

    name: str
    state: str  # "running" | "restarting" | "stopped"
    restarts: int
    last_error: str | None
    last_error_at: float | None  # unix seconds
    next_restart_in_s: float | None

    def as_dict(self) -> dict:
        return self.__dict__.copy()


class Worker:
    """One supervised thread.

    Args:
        name: the worker's name in logs, metrics and ``/readyz`` (``ingest``, ``scheduler``, ``reconcile``, ``canary``).
        target: ``target(stop)``; runs until ``stop`` is set, returns then. Raising means it died.
        on_stop: called by :meth:`stop` after ``stop`` is set, to wake a target blocked elsewhere.
        initial_s, max_s: the backoff between restarts, seconds.
        healthy_after_s: a run this long resets the backoff.
    """

    def __init__(
        self,
        name: str,
        target: Callable[[threading.Event], None],
        *,
        on_stop: Callable[[], None] | None = None,
        initial_s: float = 1.0,
        max_s: float = 60.0,
        healthy_after_s: float = 60.0,
    ) -> None:
        self.name = name
        self._target = target
        self._on_stop = on_stop
        self._wait = wait_exponential(multiplier=initial_s, max=max_s)
        self._healthy_after_s = healthy_after_s
        self.stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._state = "stopped"
        self._restarts = 0
        self._streak = 0  # failures in a row (reset by a healthy run)
        self._last_error: str | None = None
        self._last_error_at: float | None = None
        self._restart_at: float | None = None
        WORKER_UP.labels(name).set(0)

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self.stop_event.clear()
        self._thread = threading.Thread(target=self._loop, name=f"worker-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Ask the worker to stop and wait; True when its thread ended within ``timeout_s``."""
        self.stop_event.set()
        if self._on_stop is not None:
            self._on_stop()
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        """True while the worker runs its target (not while it waits to restart)."""
        return self._state == "running" and self._thread is not None and self._thread.is_alive()

    def state(self) -> WorkerState:
        wait = None if self._restart_at is None else max(0.0, self._restart_at - time.monotonic())
        state = self._state if self._thread is not None and self._thread.is_alive() else "stopped"
        return WorkerState(self.name, state, self._restarts, self._last_error, self._last_error_at, wait)

    def _loop(self) -> None:
        while not self.stop_event.is_set():
            self._state = "running"
            WORKER_UP.labels(self.name).set(1)
            started = time.monotonic()
            try:
                self._target(self.stop_event)
            except Exception as err:  # noqa: BLE001 - any death is supervised, not fatal to the process
                WORKER_UP.labels(self.name).set(0)
                if self.stop_event.is_set():
                    log.warning("worker %s raised while stopping: %s", self.name, err)
                    break
                self._streak = 1 if time.monotonic() - started >= self._healthy_after_s else self._streak + 1
                delay = float(self._wait(attempt_state(self._streak)))
                self._restarts += 1
                self._last_error, self._last_error_at = f"{type(err).__name__}: {err}", time.time()
                WORKER_RESTARTS.labels(self.name).inc()
                log.exception(
                    "worker %s died (%s); restart %d in %.1fs", self.name, self._last_error, self._restarts, delay
                )
                self._state = "restarting"
                self._restart_at = time.monotonic() + delay
                self.stop_event.wait(delay)
                self._restart_at = None
                continue
            if not self.stop_event.is_set():  # returned without being asked: restart it too
                log.warning("worker %s returned without a stop request; restarting it", self.name)
                self._restarts += 1
                WORKER_RESTARTS.labels(self.name).inc()
                self.stop_event.wait(float(self._wait(attempt_state(1))))
        self._state = "stopped"
        WORKER_UP.labels(self.name).set(0)
