"""``areal-fn`` speaks in flags and the user's own paths (#30 item 4), takes the habits
users bring (#30 item 7: a global ``--json``, flags between positionals, Megatron-Core's
``etp`` default said) and says how a published checkpoint is stored (#30 item 5).

Every error line any test makes the CLI print is also checked by the autouse fixture of
``tests/conftest.py`` (:mod:`tests.cli_terms`)."""

import json
import re
from pathlib import Path

import pytest
import torch

from areal_fn.cli import main
from areal_fn.model.demo import DEMO_CONFIG
from areal_fn.model.spec import model_from_hf_config
from areal_fn.runtime.hf.io import write_hf_checkpoint
from areal_fn.strategy.parse import parse_allocation
from tests.cli_terms import cli_term_problems

ROOT = Path(__file__).resolve().parents[2]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own refusals
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model as an HF checkpoint."""
    model = model_from_hf_config(DEMO_CONFIG)
    gen = torch.Generator().manual_seed(0)
    tensors = {t.name: torch.randn(t.shape, generator=gen) for t in model.tensors}
    return write_hf_checkpoint(tmp_path_factory.mktemp("cli") / "hf", tensors, model=model)


def test_the_term_check_catches_what_the_probe_found() -> None:
    """The check itself: the three messages the new-user probe quoted fail it."""
    probe = [
        ("kv_cache: context_len=0 must be >= 1; pass e.g. context_len=1", ["plan", "x"]),
        ("suggest_strategy: top=0 must be >= 1", ["plan", "x"]),
        ("the checksums were not read; pass verify to read them", ["checkpoint"]),
        ("[Errno 1] Operation not permitted: '/sys/.areal_out.y2uw686k'", ["/sys/areal_out"]),
    ]
    assert all(cli_term_problems(line, argv) for line, argv in probe)
    assert not cli_term_problems("--context-len 0 must be >= 1", ["plan"])
    assert not cli_term_problems("ckpt/step-1/.metadata is damaged", ["inspect", "ckpt"])


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("/sys/areal_pictures", r"cannot write pictures there: Operation not permitted; choose"),
        ("{file}", r"cannot write pictures there: File exists; a file of that name is in the way"),
        ("{file}/sub", r"cannot write pictures there: Not a directory; a part of the path is a"),
    ],
)
def test_a_bad_png_target_fails_before_the_plan_prints_anything(
    target: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("x")
    png = target.format(file=tmp_path / "file")
    rc, out, err = _run(["plan", "demo", "megatron:t2", "--png", png], capsys)
    assert rc == 2 and out == ""
    assert re.fullmatch(rf"areal-fn: error: --png {re.escape(png)}: {message}.*\n", err)


def test_a_write_into_a_forbidden_place_names_dst_not_a_temporary_directory(
    hf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in (
        ["convert", str(hf), "megatron:t2", "/sys/areal_out"],
        ["convert", str(hf), "megatron:t2", "/sys/areal_out", "--format", "torch_dist"],
    ):
        rc, out, err = _run(argv, capsys)
        assert (
            rc == 2
            and out == ""
            and err.endswith(
                "areal-fn: error: DST /sys/areal_out: cannot write it: Operation not permitted; "
                "choose a place you may write, or fix its permissions\n"
            )
        ), err
    rc, _, err = _run(["convert", str(hf), "megatron:t2", str(hf / "config.json" / "out")], capsys)
    assert rc == 2 and err.endswith(
        f"areal-fn: error: DST {hf}/config.json/out: cannot write it ({hf}/config.json: File "
        "exists); a file of that name is in the way: choose another path\n"
    ), err
    local = tmp_path / "local"
    assert _run(["convert", str(hf), "megatron:t2", str(local)], capsys)[0] == 0
    rc, _, err = _run(["convert", str(local), "/sys/areal_hf", "--to-hf"], capsys)
    assert rc == 2 and err.endswith(
        "areal-fn: error: DST /sys/areal_hf: cannot write it: Operation not permitted; "
        "choose a place you may write, or fix its permissions\n"
    ), err


def test_json_before_the_command_is_the_commands_own(
    hf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = ["plan", "Qwen3-30B-A3B", "megatron:d2t2e2"]
    rc, after, _ = _run([*plan, "--json"], capsys)
    assert rc == 0 and _run(["--json", *plan], capsys)[1] == after
    assert json.loads(after)["schema"] == "areal-fn.plan/1"
    rc, out, _ = _run(["--json", "convert", str(hf), "megatron:t2", str(tmp_path / "o")], capsys)
    assert rc == 0 and json.loads(out)["schema"] == "areal-fn.convert/1"
    for argv, words in ((["models"], "models"), (["demo"], "demo")):
        rc, out, err = _run(["--json", *argv], capsys)
        assert (
            rc == 2
            and out == ""
            and err.endswith(
                f"areal-fn: error: --json: areal-fn {words} has no JSON output; drop --json "
                "(plan, convert and checkpoint inspect have one)\n"
            )
        )


def test_flags_go_between_positionals(
    hf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = _run(["plan", "demo", "--json", "megatron:t2"], capsys)
    assert rc == 0 and json.loads(out)["allocation"] == "megatron:d1t2"
    argv = ["convert", str(hf), "--json", "megatron:t2", "--rank", "1", str(tmp_path / "o")]
    rc, out, _ = _run(argv, capsys)
    assert rc == 0 and json.loads(out)["ranks"] == [1]


def _megatron_default_etp(tp: int, pp: int, ep: int) -> int:
    """Megatron-Core's own ``expert_tensor_parallel_size`` when none is given."""
    from megatron.core.model_parallel_config import ModelParallelConfig

    config = ModelParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        pipeline_dtype=torch.float32,
    )
    return int(config.expert_tensor_parallel_size)


@pytest.mark.parametrize("alloc", ["megatron:d2p2t2e2", "megatron:d4t2e4", "megatron:d2t4e2"])
def test_plan_says_etp_differs_from_megatron_cores_default(
    alloc: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The plain form gives etp 1 (AReaL's reading); plan says Megatron-Core's default
    and prints the string that asks for it, which parses to that default."""
    rc, out, _ = _run(["plan", "Qwen3-30B-A3B", alloc], capsys)
    dims = parse_allocation(alloc).training.dims
    default = _megatron_default_etp(dims.tp, dims.pp, dims.ep)
    assert rc == 0 and default == dims.tp != dims.etp == 1
    note = re.search(
        rf"experts: etp=1, as AReaL reads the plain form \S+; Megatron-Core's own default is "
        rf"etp=tp={default}: write (\S+) for that\n",
        out,
    )
    assert note is not None, out
    other = parse_allocation(note[1]).training.dims
    assert (other.etp, other.tp, other.pp, other.ep, other.dp) == (
        default,
        dims.tp,
        dims.pp,
        dims.ep,
        dims.dp,
    )
    rc, out, _ = _run(["plan", "Qwen3-30B-A3B", alloc, "--json"], capsys)
    assert json.loads(out)["components"][0]["notes"] == [note[0].strip()]


@pytest.mark.parametrize(
    ("config", "alloc"),
    [("Qwen3-30B-A3B", "megatron:d2e2"), ("Qwen3-8B", "megatron:t2"), ("Qwen3-30B-A3B", "fsdp:d2")],
)
def test_no_etp_note_where_both_readings_agree(
    config: str, alloc: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = _run(["plan", config, alloc], capsys)
    assert rc == 0 and "experts: etp" not in out
    rc, out, _ = _run(["plan", config, alloc, "--json"], capsys)
    assert json.loads(out)["components"][0]["notes"] == []


@pytest.mark.parametrize(
    ("config", "alloc", "why"),
    [
        ("gpt-oss-20b", "megatron:d2t2e2", "Megatron-Core refuses expert tensor parallelism "),
        ("Qwen3-30B-A3B", "megatron:t4e2", r"ep\*etp = 2\*4 = 8 does not divide dp\*tp\*cp = "),
    ],
)
def test_plan_says_why_megatrons_default_is_refused_where_it_is(
    config: str, alloc: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = _run(["plan", config, alloc], capsys)
    tp = parse_allocation(alloc).training.dims.tp
    assert rc == 0 and re.search(
        rf"Megatron-Core's own default is etp=tp={tp}, which is refused here \(.*{why}", out
    ), out


@pytest.mark.parametrize("name", ["DeepSeek-V3", "Kimi-K2-Instruct", "gpt-oss-20b", "Qwen3-8B"])
def test_plan_says_a_quantised_checkpoint_is_sized_in_the_compute_dtype(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Read from the published config itself: a quantization_config makes plan (text,
    JSON, --suggest) say that its sizes are of bf16 weights, not of the stored ones."""
    published = json.loads((ROOT / "specs" / "models" / f"{name}.json").read_text())
    q = published.get("quantization_config")
    alloc = "sglang:t8"
    rc, out, _ = _run(["plan", name, alloc], capsys)
    assert rc == 0
    line = [ln for ln in out.splitlines() if ln.startswith("sizes are of")]
    rc, doc, _ = _run(["plan", name, alloc, "--json"], capsys)
    stored = json.loads(doc)["model"]["checkpoint_quantization"]
    if q is None:
        assert line == [] and stored is None
        return
    assert stored.startswith(q["quant_method"])
    assert all(str(v) in stored for v in q.get("weight_block_size", []))
    assert all(m in stored for m in q.get("modules_to_not_convert", []))
    assert line == [
        f"sizes are of bfloat16 weights, as the engines hold them; the published checkpoint "
        f"stores its weights as {stored} (quantization_config), which is not what is sized here"
    ]
    rc, out, _ = _run(["plan", name, "--suggest", "64", "--device-memory", "1TB"], capsys)
    assert rc == 0 and line[0] in out.splitlines()


@pytest.fixture(scope="module")
def converted(hf: Path) -> dict[str, Path]:
    """``hf`` as megatron:t2 rank files and as a torch_dist checkpoint."""
    local, td = hf.parent / "local", hf.parent / "td"
    assert main(["convert", str(hf), "megatron:t2", str(local)]) == 0
    assert main(["convert", str(hf), "megatron:t2", str(td), "--format", "torch_dist"]) == 0
    return {"hf": hf, "local": local, "td": td}


#: (command line after ``convert``, its one line): a flag of the other direction or
#: format, which convert used to ignore.
OTHER_DIRECTION = [
    (
        ["{local}", "{out}", "--to-hf", "--rank", "1"],
        "--rank 1 with --to-hf: --to-hf reads every rank's file to write the whole HF "
        "checkpoint; drop --rank",
    ),
    (
        ["{td}", "{out}", "--to-hf", "--layer-spec", "local"],
        "--layer-spec local with --to-hf: the key names are read from the torch_dist "
        "checkpoint itself; --layer-spec applies to writing one: drop it",
    ),
    (
        ["{hf}", "megatron:t2", "{out}", "--model", "demo"],
        "--model demo applies to --to-hf (the model of rank files without a config.json); "
        "converting an HF checkpoint reads its own config.json: drop --model",
    ),
    (
        ["{local}", "{out}", "--to-hf", "--component", "actor"],
        "--component actor picks a component of the ALLOCATION given, and none was: pass the "
        "ALLOCATION, or drop --component",
    ),
    (
        ["{hf}", "megatron:t2", "{out}", "--drop-optimizer"],
        "--drop-optimizer applies to --to-hf of a torch_dist SRC; reading an HF checkpoint "
        "needs neither --trust-pickle nor --drop-optimizer: drop it",
    ),
    (
        ["{hf}", "megatron:t2", "{out}", "--format", "torch_dist", "--trust-pickle"],
        "--trust-pickle applies to --to-hf of a torch_dist SRC; reading an HF checkpoint "
        "needs neither --trust-pickle nor --drop-optimizer: drop it",
    ),
    (
        ["{local}", "{out}", "--to-hf", "--trust-pickle"],
        "--trust-pickle applies to --to-hf of a torch_dist SRC; rank files need neither "
        "--trust-pickle nor --drop-optimizer: drop it",
    ),
]


@pytest.mark.parametrize(("argv", "line"), OTHER_DIRECTION)
def test_convert_refuses_a_flag_it_would_not_use(
    argv: list[str],
    line: str,
    converted: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "out"
    words = [w.format(out=out, **converted) for w in argv]
    rc, stdout, err = _run(["convert", *words], capsys)
    assert (rc, stdout, err) == (2, "", f"areal-fn: error: {line}\n")
    assert not out.exists()


def test_drop_optimizer_of_a_checkpoint_without_optimizer_state_is_refused(
    converted: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--drop-optimizer where there is nothing to drop changed nothing: refused."""
    td, out = converted["td"], tmp_path / "out"
    argv = ["convert", str(td), str(out), "--to-hf", "--trust-pickle", "--drop-optimizer"]
    assert _run(argv, capsys) == (
        2,
        "",
        f"areal-fn: error: {td}/release: the Megatron checkpoint holds no optimizer state, so "
        "--drop-optimizer has nothing to drop: drop --drop-optimizer\n",
    )
    assert not out.exists()
