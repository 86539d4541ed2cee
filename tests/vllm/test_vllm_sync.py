"""End to end: torchrun trainers (``fsdp:d2``, ``megatron:t2``) feed a real vLLM server (TP2).

One server for the module (``VLLM_SERVER_DEV_MODE=1``, the ``areal_fn`` backend, the
sync secret in its environment). After every training step: a weight update, then vLLM
generates; vLLM's log-probs of its tokens equal the trainer's within ``LOGPROB_TOL``
(fp32); the bytes sent equal the lower bound from the layouts; vLLM reports the new
version. The final weights, exported as an HF checkpoint and loaded by a fresh vLLM,
give the server's ``/weight_checker`` checksums. Then the faults: a stale version, a
wrong secret, malformed requests, a trainer rank killed in the middle of an update;
each time vLLM keeps its weights (checksums unchanged), says why, and the next
legitimate update succeeds.
"""

import itertools
import json
import re
import secrets
from pathlib import Path
from typing import Any

import pytest

from areal_fn.runtime.launch import run_torchrun
from tests.vllm.cases import CASES, write_model
from tests.vllm.conftest import REPO, run_module, vllm_env
from tests.vllm.server import Server

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.xdist_group("vllm")]

WORKER = Path(__file__).resolve().parent / "sync_worker.py"
#: vLLM's CPU kernels against the trainer's (fp32): measured up to ~1e-6
LOGPROB_TOL = 2e-5
SECRET = secrets.token_hex(32)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("vllm_sync")
    model = write_model(root / "served", CASES["qwen2-t2"].config, seed=11)
    srv = Server(model, tp=2, secret=SECRET, log=root / "server.log")
    try:
        srv.wait()
        yield srv
    finally:
        srv.stop()


def trainer(server: Server, out: Path, strategy: str, *extra: str, secret: str = SECRET) -> Any:
    out.mkdir(parents=True, exist_ok=True)
    args = ["--url", server.url, "--model", server.model, "--strategy", strategy, "--out", str(out)]
    env = vllm_env(AREAL_FN_SYNC_SECRET=secret)
    env.pop("VLLM_CPU_OMP_THREADS_BIND")
    return run_torchrun(
        WORKER, [*args, *extra], nproc=2, timeout_s=420, env=env, cwd=REPO, check=False
    )


@pytest.fixture(scope="module")
def fsdp_run(server: Server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("fsdp")
    before = server.checksums()
    result = trainer(server, out, "fsdp:d2", "--steps", "3", "--first-version", "1")
    assert result.ok, result.output[-6000:] + server.tail()
    return {"before": before, "records": json.loads((out / "records.json").read_text()), "out": out}


def check_records(records: list[dict[str, Any]], first: int) -> None:
    assert [r["version"] for r in records] == list(range(first, first + len(records)))
    for r in records:
        assert r["weight_version"] == str(r["version"])
        assert r["bytes_sent"] == r["lower_bound"] > 0
        assert len(r["tokens"]) == len(r["vllm_logprobs"]) == len(r["trainer_logprobs"]) == 6
        diff = max(
            abs(a - b) for a, b in zip(r["vllm_logprobs"], r["trainer_logprobs"], strict=True)
        )
        assert diff <= LOGPROB_TOL, (r["version"], diff)


def test_fsdp_trainer_updates_vllm_every_step(fsdp_run: dict[str, Any]) -> None:
    records = fsdp_run["records"]
    check_records(records, 1)
    # the weights did change each time (the checksums cover embeddings, norms, biases, head)
    sums = [fsdp_run["before"], *(r["checksums"] for r in records)]
    assert all(a != b for a, b in itertools.pairwise(sums))
    assert records[0]["loss"] > records[-1]["loss"]


def test_synced_weights_equal_a_vllm_that_loaded_the_export(
    fsdp_run: dict[str, Any], server: Server
) -> None:
    out: Path = fsdp_run["out"]
    export = out / "export"
    served = Path(server.model)
    for f in served.iterdir():  # the tokenizer files vLLM's server was given
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            (export / f.name).write_bytes(f.read_bytes())
    path = out / "export_checksums.json"
    rc = run_module(
        "tests.vllm.checksum_worker",
        ["--model", str(export), "--tp", "2", "--out", str(path)],
        timeout_s=420,
        log=out / "checksum.log",
    )
    assert rc == 0, (out / "checksum.log").read_text()[-4000:]
    assert json.loads(path.read_text()) == fsdp_run["records"][-1]["checksums"]


@pytest.fixture(scope="module")
def megatron_run(
    fsdp_run: dict[str, Any], server: Server, tmp_path_factory: pytest.TempPathFactory
) -> Any:
    out = tmp_path_factory.mktemp("megatron")
    result = trainer(
        server,
        out,
        "megatron:t2",
        "--steps",
        "2",
        "--first-version",
        "10",
        "--modes",
        "sharded,full",
    )
    assert result.ok, result.output[-6000:] + server.tail()
    return json.loads((out / "records.json").read_text())


def test_megatron_trainer_updates_vllm(megatron_run: list[dict[str, Any]]) -> None:
    """The second update is ``mode="full"``: whole tensors to every vLLM rank, vLLM's own
    loaders; twice the sharded bytes at TP2 (each of 2 ranks gets the whole model)."""
    check_records(megatron_run, 10)
    assert [r["mode"] for r in megatron_run] == ["sharded", "full"]
    sharded, full = (r["bytes_sent"] for r in megatron_run)
    assert full > sharded


@pytest.fixture(scope="module")
def moe_server(megatron_run: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("vllm_moe")
    model = write_model(root / "served", CASES["qwen3_moe-t2"].config, seed=11)
    srv = Server(model, tp=2, secret=SECRET, log=root / "server.log")
    try:
        srv.wait()
        yield srv
    finally:
        srv.stop()


def test_an_moe_trainer_updates_vllm(moe_server: Server, tmp_path: Path) -> None:
    """qwen3_moe (vLLM's stacked routed experts) at TP2 from ``fsdp:d2``: every step is
    sent ``sharded`` and then ``full`` (whole tensors, vLLM's own loaders). Both serve the
    same model as the trainer's: vLLM's log-probs equal the trainer's, the bytes each
    mode's bound. (Every expert is routed to: with random routers a top-k choice can
    flip on a rounding difference.) Without the experts' repacking vLLM 0.32 skips on a
    reload (``apply._repack_moe_experts``) the log-probs are off by 0.02-0.07."""
    result = trainer(
        moe_server,
        tmp_path,
        "fsdp:d2",
        "--case",
        "qwen3_moe-t2",
        "--steps",
        "2",
        "--modes",
        "sharded,full",
        "--each",
    )
    assert result.ok, result.output[-6000:] + moe_server.tail()
    records = json.loads((tmp_path / "records.json").read_text())
    assert [r["mode"] for r in records] == ["sharded", "full"] * 2
    check_records(records, 1)
    for sharded, full in (records[0:2], records[2:4]):
        assert sharded["tokens"] == full["tokens"]
        assert sharded["vllm_logprobs"] == full["vllm_logprobs"]
        assert sharded["checksums"] == full["checksums"]
        assert full["bytes_sent"] > sharded["bytes_sent"]


def test_a_stale_version_is_refused(megatron_run: Any, server: Server, tmp_path: Path) -> None:
    before, version = server.checksums(), server.version()
    result = trainer(server, tmp_path, "fsdp:d2", "--fault", "stale", "--first-version", "3")
    assert result.ok, result.output[-6000:]
    seen = json.loads((tmp_path / "fault-stale.json").read_text())
    assert "holds version 11; version 3 is not newer" in seen["error"]
    assert server.checksums() == before and server.version() == version


def test_a_wrong_secret_is_refused_on_both_sides(
    megatron_run: Any, server: Server, tmp_path: Path
) -> None:
    before = server.checksums()
    result = trainer(
        server, tmp_path, "fsdp:d2", "--steps", "1", "--first-version", "50", secret="0" * 64
    )
    assert not result.ok
    assert "proof of the group's secret" in result.output
    assert "proof of the group's secret" in server.tail()  # the vLLM workers refused it too
    assert server.checksums() == before


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        (
            "/update_weights",
            {"update_info": {"version": "x"}},
            "version='x' must be a non-negative int",
        ),
        ("/init_weight_transfer_engine", {"init_info": {"store_port": "abc"}}, "init_info"),
        (
            "/init_weight_transfer_engine",
            {
                "init_info": {
                    "store_host": "127.0.0.1",
                    "store_port": 1,
                    "group": "g",
                    "trainer_ranks": 2,
                    "trainer_layout": {"backend": "fsdp"},
                    "layout_digest": "0",
                    "model_digest": "0",
                }
            },
            "model",
        ),
    ],
)
def test_malformed_requests_change_nothing(
    megatron_run: Any, server: Server, path: str, body: dict[str, Any], message: str
) -> None:
    before = server.checksums()
    if path == "/update_weights":  # vLLM's own protocol: an update starts first
        assert server.request("/start_weight_update", {})[0] == 200
    status, _ = server.request(path, body)
    assert status >= 400
    assert server.checksums() == before

    assert re.search(message, server.tail())


def test_a_trainer_killed_mid_update_changes_nothing(
    megatron_run: Any, server: Server, tmp_path: Path
) -> None:
    before, version = server.checksums(), server.version()
    result = trainer(
        server, tmp_path / "kill", "fsdp:d2", "--fault", "kill", "--first-version", "20"
    )
    assert not result.ok
    assert server.checksums() == before and server.version() == version
    # the next legitimate update succeeds
    result = trainer(server, tmp_path / "next", "fsdp:d2", "--steps", "1", "--first-version", "21")
    assert result.ok, result.output[-6000:] + server.tail()
    check_records(json.loads((tmp_path / "next" / "records.json").read_text()), 21)
