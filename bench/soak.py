"""Soak: mixed good and hostile traffic against a running Hourglass, with crashes.

Brings up its own broker, MLflow and vLLM (tiny random Llama) through
:mod:`pipeline.stack` on free ports, then runs ``hourglass service`` and
``hourglass gateway`` as subprocesses and, for ``--minutes``:

- sends chat requests (and feedback with the response's feedback token on
  some) through the gateway (``gateway.require_api_key = false``), plus bad
  gateway requests (invalid JSON, a lone surrogate in the model name, feedback
  without its token: a 4xx; lone surrogates in feedback metadata: never a 5xx);
- produces straight into Kafka, in random order: good traces (some in snappy,
  lz4, zstd and gzip compressed batches) and bad records of every kind —
  lone surrogate in ``metadata.user_id``, far-future and ancient ``ts``,
  ``ts`` 0 / negative / epoch seconds, late feedback, oversize, invalid JSON,
  unknown schema;
- SIGKILLs the service once (then restarts it) and runs one extra
  ``hourglass ingest`` process that is SIGKILLed and restarted once.

At the end it checks: every good trace id is in a buffer snapshot exactly
once, every bad record is in the dead-letter store (found by its marker in the
payload), every good gateway request got a 2xx and no bad one a 5xx, and
``/readyz`` of the service is ready
(no worker dead). Prints a JSON summary; exits 1 on any violation.

    python bench/soak.py --minutes 30          # the issue's soak
    python bench/soak.py --minutes 2 --keep    # quick check; keep the work folder
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import writer  # noqa: E402
from pipeline.stack import broker_service, free_port, mlflow_service, stop_group, tail, vllm_service  # noqa: E402

MODEL_CACHE = Path(os.environ.get("HOURGLASS_MODEL_CACHE", "~/.cache/hourglass/models")).expanduser()
CODECS = ("snappy", "lz4", "zstd", "gzip")
MARKER = re.compile(r"soak-bad-[a-z0-9-]+-[0-9]+-[0-9a-f]{6}")
JOIN_WINDOW_S = 8.0


def _now(delta_s: float = 0.0) -> str:
    return (datetime.now(timezone.utc) + timedelta(seconds=delta_s)).isoformat().replace("+00:00", "Z")


def _trace(trace_id: str, **over) -> dict:
    return {
        "schema": "hourglass.trace/v1",
        "trace_id": trace_id,
        "ts": _now(),
        "model": "soak",
        "prompt": "What is 2+2?",
        "completion": "4",
        "reward": 1.0,
        **over,
    }


def bad_records(n: int, max_bytes: int) -> list[tuple[str, str, bytes]]:
    """``(kind, marker, raw value)`` of one bad record of every kind; the marker is in the payload."""
    m = lambda kind: f"soak-bad-{kind}-{n}-{uuid.uuid4().hex[:6]}"  # noqa: E731
    out = []
    k = m("surrogate")
    out.append(
        ("surrogate", k, json.dumps(_trace(k, metadata={"user_id": "\ud800"})).encode())
    )  # \ud800 escape: valid JSON text
    k = m("surrogate-note")
    out.append(("surrogate-note", k, json.dumps(_trace(k, metadata={"note": "x\udfffy"})).encode()))
    for kind, ts in (
        ("far-future", "9999-12-31T23:59:59Z"),
        ("ancient", "0001-01-01T00:00:00Z"),
        ("ts-zero", 0),
        ("ts-negative", -1000),
        ("epoch-seconds", int(time.time())),
        ("old-backfill", _now(-8 * 86400)),
    ):
        k = m(kind)
        out.append((kind, k, json.dumps(_trace(k, ts=ts)).encode()))
    k = m("oversize")
    out.append(("oversize", k, json.dumps(_trace(k, completion="x" * (max_bytes + 10))).encode()))
    k = m("invalid-json")
    out.append(("invalid-json", k, f'{{"schema": "hourglass.trace/v1", "trace_id": "{k}", "ts": '.encode()))
    k = m("unknown-schema")
    out.append(("unknown-schema", k, json.dumps({**_trace(k), "schema": "hourglass.trace/v9"}).encode()))
    k = m("u2028")
    out.append(("u2028", k, json.dumps({"a": f"1\u20282 {k}"}, ensure_ascii=False).encode()))
    return out


def late_feedback(n: int) -> tuple[str, str, bytes]:
    k = f"soak-bad-late-feedback-{n}-{uuid.uuid4().hex[:6]}"
    body = {"schema": "hourglass.feedback/v1", "trace_id": k, "ts": _now(-(JOIN_WINDOW_S + 60)), "thumbs": "up"}
    return "late-feedback", k, json.dumps(body).encode()


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.workdir or tempfile.mkdtemp(prefix="hourglass-soak-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.rng = random.Random(args.seed)
        self.stack: list = []
        self.procs: dict[str, subprocess.Popen] = {}
        self.good: set[str] = set()
        self.bad: dict[str, str] = {}  # marker -> kind
        self.gateway_5xx: list[str] = []
        self.events: list[str] = []
        self.counts: dict[str, int] = {}
        self.last_feedback: tuple[str, str] = ("none", "")  # (trace id, feedback token) of the last gateway answer

    # -- setup -----------------------------------------------------------------------

    def up(self) -> None:
        from trainer.model import store as model_store

        smollm2 = model_store.pull("smollm2-135m-instruct", MODEL_CACHE).path
        tiny = model_store.build_tiny_llama(MODEL_CACHE / "tiny-random-llama", tokenizer_from=smollm2).path
        logs = self.work / "logs"
        broker = broker_service("127.0.0.1", free_port(), logs)
        mlflow = mlflow_service("127.0.0.1", free_port(), self.work / "mlflow", logs)
        vllm = vllm_service(
            tiny, "127.0.0.1", free_port(), logs, max_model_len=512, kv_cache_gib=1, max_lora_rank=16, max_loras=4
        )
        for service in (broker, mlflow, vllm):
            service.start()
            self.stack.append(service)
        suffix = uuid.uuid4().hex[:6]
        self.api_port, self.gateway_port = free_port(), free_port()
        self.conf = self.work / "hourglass.toml"
        self.conf.write_text(f"""
state_dir = "{self.work / "state"}"
[kafka]
bootstrap_servers = ["127.0.0.1:{broker.port}"]
embedded = false
traces_topic = "soak.traces.{suffix}"
feedback_topic = "soak.feedback.{suffix}"
group_id = "soak-{suffix}"
partitions = 3
max_record_bytes = 65536
[buffer]
root = "{self.work / "buffer"}"
dead_letter_root = "{self.work / "dlq"}"
feedback_join_window_s = {JOIN_WINDOW_S}
maintenance_interval_s = 4
[model]
name = "{tiny}"
[[candidates]]
name = "soak"
lora_rank = 4
lora_alpha = 8
reward = [{{ fn = "format", weight = 1.0 }}]
[rl]
steps_per_round = 2
prompts_per_step = 2
adapter_store = "offload"

[rl.rollout]
group_size = 2
max_new_tokens = 4
engine = "hf"

[rl.gate]
eval_prompts = 4
[schedule]
enabled = {"true" if self.args.rounds else "false"}
interval_s = 300
min_new_traces = 20
[registry]
tracking_uri = "http://127.0.0.1:{mlflow.port}"
embedded = false
experiment = "soak-{suffix}"
[serving]
model_name = "soak"
replicas = ["http://127.0.0.1:{vllm.port}"]
embedded = false
[api]
port = {self.api_port}
gateway_port = {self.gateway_port}
[gateway]
require_api_key = false
""")
        from connectors.kafka_admin import ensure_topics
        from pipeline.config import load_config

        self.cfg = load_config(self.conf)
        ensure_topics(self.cfg.kafka)
        self.start("service", f"http://127.0.0.1:{self.api_port}/healthz")
        self.start("gateway", f"http://127.0.0.1:{self.gateway_port}/healthz")

    def start(self, verb: str, health: str | None = None) -> None:
        log = (self.work / "logs" / f"{verb}.log").open("ab")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.procs[verb] = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", verb, "--config", str(self.conf)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        deadline = time.monotonic() + 180
        while health and time.monotonic() < deadline:
            if self.procs[verb].poll() is not None:
                raise SystemExit(f"{verb} exited during start:\n{tail(self.work / 'logs' / f'{verb}.log')}")
            try:
                if httpx.get(health, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.events.append(f"{time.strftime('%H:%M:%S')} started {verb}")

    def kill(self, verb: str) -> None:
        os.killpg(self.procs[verb].pid, signal.SIGKILL)
        self.procs[verb].wait()
        self.events.append(f"{time.strftime('%H:%M:%S')} SIGKILL {verb}")

    # -- traffic ---------------------------------------------------------------------

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def gateway_traffic(self, http: httpx.Client, n: int) -> None:
        base = f"http://127.0.0.1:{self.gateway_port}/v1"
        body = {"model": "soak", "messages": [{"role": "user", "content": f"What is {n}+1?"}], "max_tokens": 4}
        r = http.post(f"{base}/chat/completions", json=body)
        self._check(r, "chat")
        if r.status_code == 200 and (tid := r.headers.get("x-hourglass-trace-id")):
            self.good.add(tid)
            self.last_feedback = (tid, r.headers.get("x-hourglass-feedback-token", ""))
            if self.rng.random() < 0.5:
                vote = {
                    "trace_id": tid,
                    "thumbs": self.rng.choice(["up", "down"]),
                    "feedback_token": self.last_feedback[1],
                }
                self._check(http.post(f"{base}/feedback", json=vote), "feedback")
        tid, token = self.last_feedback
        bad = [  # (what, raw body, must be a 4xx); json.dumps keeps a lone surrogate as a \\ud800 escape
            ("chat", json.dumps({"model": "soak\ud800", "messages": [{"role": "user", "content": "hi"}]}), True),
            ("chat", "{not json", True),
            ("feedback", json.dumps({"trace_id": tid, "thumbs": "up"}), True),  # no feedback token
            # a user id is hashed at the gateway: storing the hash (2xx) or refusing (4xx) are both fine, a 5xx is not
            (
                "feedback",
                json.dumps(
                    {"trace_id": tid, "thumbs": "up", "feedback_token": token, "metadata": {"user_id": "\ud800"}}
                ),
                False,
            ),
            (
                "feedback",
                json.dumps({"trace_id": tid, "thumbs": "up", "feedback_token": token, "metadata": {"note": "\udfff"}}),
                False,
            ),
        ]
        what, raw, want_4xx = self.rng.choice(bad)
        path = "chat/completions" if what == "chat" else "feedback"
        r = http.post(f"{base}/{path}", content=raw.encode(), headers={"content-type": "application/json"})
        self._check(r, f"bad {what}", want_4xx=want_4xx)

    def _check(self, r: httpx.Response, what: str, want_4xx: bool | None = None) -> None:
        """``want_4xx``: None = a good request (must be 2xx), True = must be a 4xx, False = anything but a 5xx."""
        self._count(f"gateway {what} {r.status_code}")
        ok = (
            (200 <= r.status_code < 300)
            if want_4xx is None
            else (400 <= r.status_code < 500)
            if want_4xx
            else r.status_code < 500
        )
        if not ok:
            self.gateway_5xx.append(f"{what}: HTTP {r.status_code} {r.text[:200]}")

    def kafka_traffic(self, producers: dict, n: int) -> None:
        topic, fb_topic = self.cfg.kafka.traces_topic, self.cfg.kafka.feedback_topic
        kind = self.rng.choice(["good", "good", "good", "compressed", "bad", "late"])
        if kind == "good":
            tid = f"soak-good-{n}-{uuid.uuid4().hex[:6]}"
            producers["none"].send(topic, json.dumps(_trace(tid)).encode(), key=tid.encode())
            self.good.add(tid)
        elif kind == "compressed":
            codec = self.rng.choice(CODECS)
            for i in range(3):  # one batch
                tid = f"soak-good-{codec}-{n}-{i}-{uuid.uuid4().hex[:6]}"
                producers[codec].send(topic, json.dumps(_trace(tid)).encode(), key=tid.encode())
                self.good.add(tid)
            producers[codec].flush()
        elif kind == "bad":
            for bad_kind, marker, raw in self.rng.sample(bad_records(n, self.cfg.kafka.max_record_bytes), 3):
                producers["none"].send(topic, raw, key=marker.encode())
                self.bad[marker] = bad_kind
        else:
            bad_kind, marker, raw = late_feedback(n)
            producers["none"].send(fb_topic, raw, key=marker.encode())
            self.bad[marker] = bad_kind
        self._count(f"kafka {kind}")

    def run(self) -> dict:
        from kafka import KafkaProducer

        servers = self.cfg.kafka.bootstrap_servers
        big = self.cfg.kafka.max_record_bytes * 4
        producers = {"none": KafkaProducer(bootstrap_servers=servers, max_request_size=big)}
        for codec in CODECS:
            producers[codec] = KafkaProducer(
                bootstrap_servers=servers, compression_type=codec, max_request_size=big, linger_ms=50
            )
        total = self.args.minutes * 60
        started = time.monotonic()
        kill_service_at, ingest_at, kill_ingest_at = total * 0.5, total * 0.3, total * 0.6
        done = set()
        n = 0
        with httpx.Client(timeout=60) as http:
            while (elapsed := time.monotonic() - started) < total:
                n += 1
                if self.rng.random() < 0.3:
                    self.gateway_traffic(http, n)
                else:
                    self.kafka_traffic(producers, n)
                if elapsed >= ingest_at and "ingest" not in done:
                    self.start("ingest")
                    done.add("ingest")
                if elapsed >= kill_ingest_at and "kill-ingest" not in done:
                    self.kill("ingest")
                    self.start("ingest")
                    done.add("kill-ingest")
                if elapsed >= kill_service_at and "kill-service" not in done:
                    self.kill("service")
                    self.start("service", f"http://127.0.0.1:{self.api_port}/healthz")
                    done.add("kill-service")
                time.sleep(self.rng.uniform(0, 2 / self.args.rate))
        for producer in producers.values():
            producer.flush(60)
            producer.close()
        return self.verify()

    # -- checks ----------------------------------------------------------------------

    def _dead_lettered_markers(self) -> set[str]:
        """Markers of the bad records found in the dead-letter store (payload, key or detail)."""
        from connectors.dead_letter import DeadLetterStore

        found: set[str] = set()
        for row in DeadLetterStore(self.cfg.buffer.dead_letter_root).list():
            text = " ".join(str(row.get(k) or "") for k in ("payload", "key", "detail"))
            if row.get("payload_b64"):
                text += base64.b64decode(row["payload_b64"]).decode("utf-8", "replace")
            found.update(MARKER.findall(text))
        return found

    def verify(self) -> dict:
        from connectors.buffer import RewardBuffer

        violations: list[str] = []
        deadline = time.monotonic() + self.args.settle_s
        missing_good, missing_bad, dupes = set(self.good), dict(self.bad), []
        errors: dict[str, str] = {}
        while time.monotonic() < deadline:  # let ingest catch up (and late feedback be swept)
            try:  # each store on its own: one unreadable store must not hide the other's result
                ids = RewardBuffer(self.cfg.buffer).snapshot().column("trace_id").to_pylist()
                missing_good = self.good - set(ids)
                dupes = sorted(i for i, count in Counter(ids).items() if count > 1)
                errors.pop("buffer", None)
            except Exception as err:  # noqa: BLE001 - the soak reports, never dies on one read
                errors["buffer"] = f"{type(err).__name__}: {err}"
            try:
                dlq = self._dead_lettered_markers()
                missing_bad = {m: k for m, k in self.bad.items() if m not in dlq}
                errors.pop("dead-letter store", None)
            except Exception as err:  # noqa: BLE001
                errors["dead-letter store"] = f"{type(err).__name__}: {err}"
            if not missing_good and not missing_bad and not errors:
                break
            time.sleep(3)
        violations += [f"{what} unreadable: {error}" for what, error in errors.items()]
        if missing_good:
            violations.append(f"{len(missing_good)} good trace(s) not in the buffer, e.g. {sorted(missing_good)[:5]}")
        if dupes:
            violations.append(f"{len(dupes)} trace id(s) more than once in the snapshot, e.g. {dupes[:5]}")
        if missing_bad:
            kinds: dict[str, int] = {}
            for kind in missing_bad.values():
                kinds[kind] = kinds.get(kind, 0) + 1
            violations.append(f"bad records not in the dead-letter store, by kind: {kinds}")
        if self.gateway_5xx:
            violations.append(f"{len(self.gateway_5xx)} gateway answer(s) not as expected, e.g. {self.gateway_5xx[:3]}")
        for verb, proc in self.procs.items():
            if proc.poll() is not None:
                violations.append(f"{verb} exited with code {proc.returncode}")
        try:
            ready = httpx.get(f"http://127.0.0.1:{self.api_port}/readyz", timeout=30)
            checks = ready.json().get("checks", {})
            if ready.status_code != 200:
                violations.append(
                    f"/readyz {ready.status_code}: failing checks {[k for k, v in checks.items() if not v]}"
                )
            workers = httpx.get(f"http://127.0.0.1:{self.api_port}/status", timeout=30).json().get("workers", {})
        except httpx.HTTPError as err:
            violations.append(f"service API unreachable at the end: {err}")
            checks, workers = {}, {}
        return {
            "minutes": self.args.minutes,
            "work_dir": str(self.work),
            "events": self.events,
            "sent": self.counts,
            "good_traces": len(self.good),
            "bad_records": len(self.bad),
            "readyz": checks,
            "worker_restarts": {name: w.get("restarts") for name, w in workers.items()},
            "violations": violations,
        }

    def down(self) -> None:
        for verb, proc in self.procs.items():
            if proc.poll() is None:
                stop_group(proc.pid, grace_s=90 if verb == "service" else 20)
        for service in reversed(self.stack):
            service.stop()
        if not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="How long to send traffic.")
    parser.add_argument("--rate", type=float, default=10.0, help="Traffic actions per second, on average.")
    parser.add_argument(
        "--settle-s", type=float, default=120.0, help="How long to wait for ingest to catch up at the end."
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", action="store_true", help="Let the scheduler run rounds every 5 min meanwhile.")
    parser.add_argument("--workdir", help="Work folder (default: a new temporary folder).")
    parser.add_argument("--keep", action="store_true", help="Keep the work folder (logs, buffer, dead letters).")
    writer.add_arguments(parser)
    args = parser.parse_args()
    recorder = writer.Recorder("soak", args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    soak = Soak(args)
    try:
        soak.up()
        summary = soak.run()
    finally:
        soak.down()
    violations = summary["violations"]
    recorder.write(
        f"{args.minutes:g}-min" + ("-rounds" if args.rounds else ""),
        title=f"{args.minutes:g} minutes at {args.rate:g} actions/s" + (", rounds every 5 min" if args.rounds else ""),
        columns=["what", "count"],
        rows=[[f"sent: {kind}", count] for kind, count in sorted(summary["sent"].items())]
        + [
            ["good trace ids (each must be in the snapshot exactly once)", summary["good_traces"]],
            ["bad records (each must be dead-lettered or refused with a 4xx)", summary["bad_records"]],
            ["worker restarts", sum(v or 0 for v in summary["worker_restarts"].values())],
            ["violations", len(violations)],
        ],
        result="no violation" if not violations else f"{len(violations)} violation(s): " + "; ".join(violations)[:500],
        notes=["events: " + "; ".join(summary["events"])] if summary.get("events") else [],
    )
    print(json.dumps(summary, indent=2, default=str))
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
