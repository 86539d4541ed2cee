"""A real vLLM OpenAI server in a process of its own, with the areal_fn backend."""

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.vllm.conftest import REPO, VLLM_PYTHON, vllm_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` serving ``model`` at TP ``tp``."""

    def __init__(self, model: Path, *, tp: int, secret: str, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model)
        self.log = log
        self._out = log.open("w")
        self.proc = subprocess.Popen(
            [
                VLLM_PYTHON,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                self.model,
                "--tensor-parallel-size",
                str(tp),
                "--dtype",
                "float32",
                "--enforce-eager",
                "--max-model-len",
                "256",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--weight-transfer-config",
                json.dumps({"backend": "areal_fn"}),
            ],
            cwd=REPO,
            env=vllm_env(VLLM_SERVER_DEV_MODE="1", AREAL_FN_SYNC_SECRET=secret),
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )

    def wait(self, timeout_s: float = 300.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"vLLM server not up after {timeout_s}s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text()[-6000:]

    def request(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        """(status, JSON answer or text) of a request (POST with a body, else GET)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def checksums(self) -> dict[str, str]:
        status, got = self.request("/weight_checker", {"action": "checksum"})
        assert status == 200, got
        return dict(got["checksums"])

    def version(self) -> Any:
        status, got = self.request("/weight_info")
        assert status == 200, got
        return got["weight_version"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._out.close()
