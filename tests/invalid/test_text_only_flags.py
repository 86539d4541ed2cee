"""A multimodal checkpoint's tensors that are not its text model: refused, listed, by the
readers and ``areal-fn convert`` unless ``text_only=True`` / ``--text-only``; every misuse
of the option refused in the library's words and, on the command line, in the flag's."""

import re
from pathlib import Path

import pytest
import torch

from areal_fn.cli import main
from areal_fn.errors import ConversionError
from areal_fn.layouts.layout_for import layout_for
from areal_fn.model.spec import model_from_hf_config
from areal_fn.runtime.hf.convert import convert_to_local
from areal_fn.runtime.hf.io import HfCheckpoint, write_hf_checkpoint
from areal_fn.runtime.hf.load_into import load_into
from tests.oracles.test_multimodal_checkpoints import tiny_published

CONFIG = tiny_published("Qwen3.5-27B.json")
SPEC = model_from_hf_config(CONFIG)
OTHERS = {"model.visual.pos_embed.weight": (16, 16), "mtp.fc.weight": (16, 32)}


def _published(path: Path, *, config: object = CONFIG, both: bool = False) -> Path:
    """A checkpoint named as the published one holds it: the text model under
    ``model.language_model.``, ``lm_head.weight``, and :data:`OTHERS`; ``both``: also one
    tensor under its canonical name."""
    g = torch.Generator().manual_seed(5)
    tensors = {}
    for t in SPEC.tensors:
        stored = t.name.replace("model.", "model.language_model.", 1)
        tensors[stored] = torch.randn(t.shape, generator=g)
    tensors.update({n: torch.randn(s, generator=g) for n, s in OTHERS.items()})
    if both:
        tensors["model.norm.weight"] = torch.ones(16)
    return write_hf_checkpoint(path, tensors, config=config)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _published(tmp_path_factory.mktemp("mm") / "hf")


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The text model's own checkpoint (canonical names, its text config)."""
    g = torch.Generator().manual_seed(6)
    tensors = {t.name: torch.randn(t.shape, generator=g) for t in SPEC.tensors}
    return write_hf_checkpoint(tmp_path_factory.mktemp("text") / "hf", tensors, model=SPEC)


REFUSED = (
    r"is a qwen3_5 checkpoint \(its config.json's model_type\), read as its text model "
    r"qwen3_5_text \(model.language_model.\* as model.\*\), and it holds 2 tensors that are "
    r"not the text model: the vision encoder \(model.visual.\*: 1\), the "
    r"multi-token-prediction layers \(mtp.\*: 1\): \['model.visual.pos_embed.weight', "
    r"'mtp.fc.weight'\]; the model read has no place for them: pass "
)
LIBRARY = (
    r"text_only=True \(HfCheckpoint.check, load_into, convert_to_local, "
    r"convert_to_torch_dist\) to leave them out \(listed as not carried\)$"
)
NOT_MULTIMODAL = (
    r"is not a multimodal checkpoint read as its text model \(its config.json's model_type "
    r"is not one of qwen3_5, qwen3_5_moe\), so there is nothing to leave out; drop "
)


def _err(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("areal-fn: error: ") and "Traceback" not in err
    assert "\n" not in err, err
    return err


def test_the_readers_refuse_what_is_not_the_text_model(published, tmp_path) -> None:
    with HfCheckpoint(published) as ckpt, pytest.raises(ConversionError, match=REFUSED + LIBRARY):
        ckpt.check(SPEC)
    layout = layout_for(SPEC, "fsdp:d1")
    out = {lt.name: torch.empty(lt.shape) for lt in layout.local_tensors(0)}
    with pytest.raises(ConversionError, match=REFUSED + LIBRARY):
        load_into(published, layout, 0, out=out)
    with pytest.raises(ConversionError, match=REFUSED + LIBRARY):
        convert_to_local(published, "fsdp:d1", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_command_refuses_them_in_its_flags_words(published, tmp_path, capsys) -> None:
    err = _err(capsys, ["convert", str(published), "fsdp:d2", str(tmp_path / "out")])
    assert re.search(REFUSED + r"--text-only to leave them out \(listed as not carried\)$", err)
    assert not (tmp_path / "out").exists()


def test_text_only_on_a_checkpoint_that_is_not_multimodal(plain, tmp_path, capsys) -> None:
    with HfCheckpoint(plain) as ckpt:
        assert ckpt.check(SPEC) == ()
        with pytest.raises(ConversionError, match=r"^text_only=True: .*" + NOT_MULTIMODAL):
            ckpt.check(SPEC, text_only=True)
    err = _err(capsys, ["convert", str(plain), "fsdp:d2", str(tmp_path / "o"), "--text-only"])
    assert re.search(r"--text-only: .*" + NOT_MULTIMODAL + r"--text-only$", err), err
    assert not (tmp_path / "o").exists()


def test_text_only_does_not_apply_to_writing_hf(published, tmp_path, capsys) -> None:
    err = _err(capsys, ["convert", str(published), str(tmp_path / "o"), "--to-hf", "--text-only"])
    assert err.endswith(
        "--text-only applies to reading an HF checkpoint; --to-hf writes the tensors the "
        "files hold: drop --text-only"
    )


def test_a_tensor_held_under_both_names_is_refused(tmp_path) -> None:
    path = _published(tmp_path / "hf", both=True)
    with pytest.raises(
        ConversionError,
        match=r"holds both 'model.language_model.norm.weight' and 'model.norm.weight', the same "
        r"tensor of the text model \(a qwen3_5 checkpoint stores it under the first name\); the "
        r"checkpoint is inconsistent: save it again with one of them$",
    ):
        HfCheckpoint(path)


def test_wrapped_names_without_the_published_config_are_unexpected(tmp_path) -> None:
    path = _published(tmp_path / "hf", config=SPEC.hf_config())
    with (
        HfCheckpoint(path) as ckpt,
        pytest.raises(
            ConversionError,
            match=r"the checkpoint names its tensors as a multimodal model stores its text model "
            r"\('model.language_model.'\), read as that text model when config.json is the "
            r"published one \(model_type qwen3_5, qwen3_5_moe\): put it beside the weights",
        ),
    ):
        ckpt.check(SPEC, text_only=False)


DROP_MTP = (
    r"is a qwen3_5 checkpoint, read as its text model, whose multi-token-prediction layers "
    r"\(mtp.\*\) are not decoder layers but a part that is not the text model: pass "
)


def test_drop_mtp_points_to_text_only(published, tmp_path, capsys) -> None:
    with (
        HfCheckpoint(published) as ckpt,
        pytest.raises(
            ConversionError,
            match=r"^drop_mtp=True: .*"
            + DROP_MTP
            + LIBRARY.removesuffix(r" \(listed as not carried\)$")
            + r", and drop drop_mtp=True$",
        ),
    ):
        ckpt.check(SPEC, drop_mtp=True, text_only=True)
    err = _err(capsys, ["convert", str(published), "fsdp:d2", str(tmp_path / "o"), "--drop-mtp"])
    assert re.search(
        r"--drop-mtp: .*" + DROP_MTP + r"--text-only to leave them out, and drop --drop-mtp$", err
    ), err


def test_merging_adapters_into_a_multimodal_base_refuses_its_other_parts(
    published, tmp_path, capsys
):
    """``export_merged`` writes the text model alone: a base's vision encoder and ``mtp.*``
    are refused, never left out unsaid."""
    from areal_fn.layouts.fsdp2 import fsdp2_layout
    from areal_fn.layouts.lora import adapter_layout
    from areal_fn.model.lora import LoraConfig, lora_tensors
    from areal_fn.plans.convert import to_megatron
    from areal_fn.runtime.checkpoint import RankState, save_checkpoint
    from areal_fn.runtime.checkpoint.lora import export_merged, lora_hf_files
    from areal_fn.strategy.allocation import ParallelDims

    lora = LoraConfig(rank=2, alpha=4.0, target_modules=("up_proj",))
    adapters = {s.name: torch.ones(s.shape) for s in lora_tensors(SPEC, lora)}
    layout = adapter_layout(fsdp2_layout(SPEC, ParallelDims(dp=1)), SPEC, lora)
    ckpt = save_checkpoint(
        tmp_path / "ckpt",
        layout=layout,
        states={0: RankState(params=to_megatron(adapters, layout, 0))},
        model=SPEC,
        allocation="fsdp:d1",
        step=1,
        save_rng=False,
        hf=lora_hf_files(SPEC, lora),
    )
    with pytest.raises(
        ConversionError,
        match=REFUSED.removesuffix("pass ") + r"the merged checkpoint is the text model alone: "
        r"write the base as the text model's checkpoint first \(convert it with text_only=True "
        r"to rank files, and those back to HF\), then merge into that$",
    ):
        export_merged(ckpt, published, tmp_path / "merged")
    err = _err(
        capsys, ["convert", str(ckpt), str(tmp_path / "m"), "--to-hf", "--merge", str(published)]
    )
    assert err.endswith(
        "(convert it with --text-only to rank files, and those back to HF), then merge into that"
    ), err
    assert not (tmp_path / "merged").exists()
