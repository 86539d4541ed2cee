"""Launch a script under ``torchrun`` on this machine and collect what each rank said.

Used by the multi-process tests (``tests/distributed``) and usable from any driver::

    result = run_torchrun("tests/distributed/megatron_worker.py", ["--out", str(out)], nproc=4)
    print(result.rank_stdout[0])

The launch gets a free ``--master-port`` (retried once on a port clash), a wall-clock
timeout that kills the whole process tree, and per-rank log files; on failure a
:class:`LaunchError` carries every rank's stderr tail. The ranks of one launch share a
fresh random weight-sync secret in ``AREAL_FN_SYNC_SECRET`` (unless the caller's
environment or ``env`` sets one), so that their sync groups are authenticated
(:mod:`areal_fn.runtime.sync.auth`).
"""

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from areal_fn.runtime.sync.auth import SECRET_ENV
from areal_fn.typecheck import beartype

__all__ = ["LaunchError", "LaunchResult", "free_port", "run_torchrun"]

_PORT_CLASH = ("address already in use", "EADDRINUSE", "errno: 98")


@beartype
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@attrs.frozen(kw_only=True)
class LaunchResult:
    """What a torchrun launch produced: exit status, launcher output, per-rank output."""

    command: tuple[str, ...]
    returncode: int
    timed_out: bool
    duration_s: float
    output: str
    rank_stdout: tuple[str, ...]
    rank_stderr: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """The launch finished in time and every rank exited 0."""
        return self.returncode == 0 and not self.timed_out

    def report(self, *, tail_chars: int = 4000) -> str:
        """A readable summary: command, status, each rank's stderr tail, launcher tail."""
        status = "timed out" if self.timed_out else f"exit code {self.returncode}"
        parts = [f"torchrun {status} after {self.duration_s:.1f}s: {' '.join(self.command)}"]
        for rank, err in enumerate(self.rank_stderr):
            parts.append(f"--- rank {rank} stderr (tail) ---\n{err[-tail_chars:]}")
        parts.append(f"--- launcher output (tail) ---\n{self.output[-tail_chars:]}")
        return "\n".join(parts)


class LaunchError(RuntimeError):
    """A torchrun launch failed or timed out; ``result`` holds everything it printed."""

    def __init__(self, result: LaunchResult) -> None:
        super().__init__(result.report())
        self.result = result


@beartype
def run_torchrun(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    nproc: int,
    timeout_s: float | int = 180.0,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    python: str = sys.executable,
    check: bool = True,
    port_retries: int = 1,
) -> LaunchResult:
    """Run ``python -m torch.distributed.run --nproc-per-node nproc script *args``.

    ``env`` is added to this process's environment (``OMP_NUM_THREADS=1`` unless set;
    ``AREAL_FN_SYNC_SECRET``, the secret of the ranks' weight-sync groups, a fresh random
    one per launch unless set).
    Each rank's stdout/stderr is captured separately (torchrun ``--redirects 3``) and
    also echoed, prefixed with the rank, into the launcher output. The process tree
    is killed after ``timeout_s``. With ``check`` a failed or timed-out launch raises
    :class:`LaunchError` carrying every rank's stderr.
    """
    result = _launch_once(script, args, nproc, timeout_s, env, cwd, python)
    while port_retries > 0 and not result.ok and _is_port_clash(result):
        port_retries -= 1
        result = _launch_once(script, args, nproc, timeout_s, env, cwd, python)
    if check and not result.ok:
        raise LaunchError(result)
    return result


def _is_port_clash(result: LaunchResult) -> bool:
    text = (result.output + "".join(result.rank_stderr)).lower()
    return any(marker.lower() in text for marker in _PORT_CLASH)


def _launch_once(
    script: str | os.PathLike[str],
    args: Sequence[str],
    nproc: int,
    timeout_s: float,
    env: Mapping[str, str] | None,
    cwd: str | os.PathLike[str] | None,
    python: str,
) -> LaunchResult:
    log_dir = Path(tempfile.mkdtemp(prefix="areal_fn_torchrun_"))
    command = (
        python,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "--log-dir",
        str(log_dir),
        "--redirects",
        "3",
        "--tee",
        "3",
        os.fspath(script),
        *args,
    )
    full_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    full_env.update(env or {})
    if not full_env.get(SECRET_ENV):  # the ranks' sync groups share it, nobody else has it
        full_env[SECRET_ENV] = secrets.token_hex(32)
    start = time.monotonic()
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    timed_out = False
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_tree(process)
        output, _ = process.communicate()
    duration = time.monotonic() - start
    try:
        rank_stdout = _rank_logs(log_dir, nproc, "stdout.log")
        rank_stderr = _rank_logs(log_dir, nproc, "stderr.log")
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    return LaunchResult(
        command=command,
        returncode=process.returncode if not timed_out else -signal.SIGKILL,
        timed_out=timed_out,
        duration_s=duration,
        output=output or "",
        rank_stdout=rank_stdout,
        rank_stderr=rank_stderr,
    )


def _kill_tree(process: "subprocess.Popen[str]") -> None:
    # The launcher leads its own session (start_new_session): signal that group only.
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def _rank_logs(log_dir: Path, nproc: int, filename: str) -> tuple[str, ...]:
    # torchrun writes <log_dir>/<run_id>/attempt_<n>/<local_rank>/{stdout,stderr}.log;
    # keep the latest attempt's text per rank.
    texts: list[str] = []
    for rank in range(nproc):
        found = sorted(log_dir.glob(f"*/attempt_*/{rank}/{filename}"))
        texts.append(found[-1].read_text(errors="replace") if found else "")
    return tuple(texts)
