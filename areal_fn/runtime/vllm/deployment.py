"""A vLLM deployment as the trainer drives it: its HTTP server, or an ``LLM`` object.

Both speak vLLM's own weight-update API: ``/pause``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``, ``/update_weight_version``,
``/resume`` (HTTP: mounted by ``VLLM_SERVER_DEV_MODE=1``), or the same methods of
``vllm.LLM``. Failures raise :class:`VllmError` with vLLM's answer.
"""

import json
import urllib.error
import urllib.request
from typing import Any, Protocol

__all__ = ["HttpDeployment", "LlmDeployment", "VllmDeployment", "VllmError", "as_deployment"]


class VllmError(RuntimeError):
    """vLLM refused or failed a request (the message carries its answer)."""


class VllmDeployment(Protocol):
    """What the trainer needs of a vLLM deployment."""

    def world_size(self) -> int:
        """Ranks of one replica: tensor x pipeline parallel."""
        ...

    def call(self, method: str, body: dict[str, Any] | None = None) -> Any:
        """Run one of vLLM's weight-update methods (``start_weight_update``, ...)."""
        ...


class HttpDeployment:
    """A vLLM OpenAI-compatible server at ``url`` (``http://host:port``)."""

    def __init__(self, url: str, *, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"HttpDeployment({self.url!r})"

    def _request(self, path: str, body: dict[str, Any] | None, method: str) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            raise VllmError(
                f"vLLM at {self.url}: {method} {path} answered {e.code}: {detail}"
            ) from e
        except (urllib.error.URLError, OSError) as e:
            raise VllmError(f"vLLM at {self.url}: {method} {path} failed: {e}") from e
        return json.loads(raw) if raw else None

    def world_size(self) -> int:
        got = self._request("/get_world_size?include_dp=false", None, "GET")
        return int(got["world_size"])

    def call(self, method: str, body: dict[str, Any] | None = None) -> Any:
        if method == "weight_info":
            return self._request("/weight_info", None, "GET")
        if method == "pause":
            mode = (body or {}).get("mode", "keep")
            return self._request(f"/pause?mode={mode}", None, "POST")
        return self._request(f"/{method}", body or {}, "POST")


class LlmDeployment:
    """An offline ``vllm.LLM`` in this process (its engine runs in its own processes)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def __repr__(self) -> str:
        return "LlmDeployment(vllm.LLM)"

    def world_size(self) -> int:
        return int(self.llm.llm_engine.vllm_config.parallel_config.world_size)

    def call(self, method: str, body: dict[str, Any] | None = None) -> Any:
        body = body or {}
        try:
            if method in ("pause", "resume"):
                return None  # an offline LLM generates only when called
            if method == "init_weight_transfer_engine":
                return self.llm.init_weight_transfer_engine({"init_info": body["init_info"]})
            if method == "update_weights":
                return self.llm.update_weights({"update_info": body["update_info"]})
            if method == "update_weight_version":
                return self.llm.update_weight_version(body["new_version"])
            if method == "weight_info":
                return {"weight_version": self.llm.get_weight_version()}
            return getattr(self.llm, method)(**body)
        except Exception as e:
            raise VllmError(f"vLLM (offline LLM): {method} failed: {e}") from e


def as_deployment(target: Any) -> VllmDeployment:
    """``target``: an ``http://`` address, a ``vllm.LLM``, or a deployment already."""
    if isinstance(target, str):
        if not target.startswith(("http://", "https://")):
            raise ValueError(
                f"vLLM deployment {target!r} is not an http:// address; give the server's "
                "address (http://host:port) or a vllm.LLM object"
            )
        return HttpDeployment(target)
    if isinstance(target, HttpDeployment | LlmDeployment):
        return target
    if type(target).__name__ == "LLM" and hasattr(target, "llm_engine"):
        return LlmDeployment(target)
    raise ValueError(
        f"vLLM deployment {target!r} is neither an http:// address nor a vllm.LLM object"
    )
