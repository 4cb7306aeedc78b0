"""A real ``attn-stack serve`` in a subprocess on a free port, and helpers to talk to it."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 300.0  # loading a model and starting uvicorn on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``attn-stack serve`` subprocess: started by ``__init__``, ready after ``wait_ready``."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        """``args``: the command's; ``env``: variables set for the server on top of this process's."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.TemporaryFile()
        env = dict(os.environ, **(env or {}))
        env.setdefault("JAX_PLATFORMS", "cpu")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
        command = [sys.executable, "-m", "attn_jax", "serve", "--port", str(self.port), "--log-level", "warning"]
        self.process = subprocess.Popen([*command, *args], stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.http = httpx.Client(base_url=self.base_url, timeout=120.0)

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def wait_ready(self) -> Server:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"attn-stack serve exited with code {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                if self.http.get("/health").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        pytest.fail(f"attn-stack serve was not ready after {READY_TIMEOUT_S} s:\n{self.log()[-4000:]}")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=120.0)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=120.0)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of ``/metrics``, parsed by prometheus_client: {(name, labels): value}."""
        response = self.http.get("/metrics")
        assert response.status_code == 200, response.text
        out = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
                out[sample.name, labels] = sample.value
        return out

    def wait_for(self, condition, what: str, timeout: float = 60.0) -> dict[tuple[str, tuple], float]:
        """Polls ``/metrics`` until ``condition(metrics)`` holds; returns those metrics (fails
        the test, saying ``what`` was awaited, after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            metrics = self.metrics()
            if condition(metrics):
                return metrics
            time.sleep(0.05)
        pytest.fail(f"{what}: still not so after {timeout} s: {metrics}")

    def rss_bytes(self) -> int:
        """Resident memory of the server process and every process under it (the engine's)."""
        import psutil

        root = psutil.Process(self.process.pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])

    def close(self) -> None:
        self.http.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


USED, RUNNING = ("attn_stack_kv_cache_blocks_used", ()), ("attn_stack_num_requests_running", ())
WAITING = ("attn_stack_num_requests_waiting", ())


def idle(metrics: dict) -> bool:
    """No KV page in use and no request running or waiting (``Server.metrics``' samples)."""
    return metrics[USED] == 0 and metrics[RUNNING] == 0 and metrics[WAITING] == 0


async def stream_greedy(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    """One greedy streaming completion of exactly ``max_tokens`` tokens (``ignore_eos``):
    its text, joined from the chunks, and the usage's completion token count."""
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = [c async for c in stream]
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens


def sse_data(lines) -> Iterator[str]:
    """The ``data:`` payloads of a server-sent event stream's lines, as they arrive."""
    return (line[len("data: ") :] for line in lines if line.startswith("data: "))
