"""Oracle: a published multimodal Qwen3.5 checkpoint read as its text model.

Tiny ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` built
from the published configs (``specs/models``) shrunk, saved by transformers'
``save_pretrained`` (the text model under ``model.language_model.``, the vision encoder
under ``model.visual.``), with a few ``mtp.*`` tensors added by safetensors as the
published checkpoints hold them. Read by ``HfCheckpoint``, ``load_into`` and
``areal-fn convert --text-only``, the canonical tensors equal bitwise the text model's
own (transformers' state dict, and the file's bytes), and transformers' text model
(``Qwen3_5ForCausalLM``) holding what we read gives the multimodal model's logits.
"""

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from areal_fn.cli import main
from areal_fn.errors import ConversionError
from areal_fn.layouts.layout_for import layout_for
from areal_fn.model.hf_memory import hf_state_to_canonical
from areal_fn.model.spec import model_from_hf_config
from areal_fn.plans.convert import to_megatron
from areal_fn.runtime.hf.convert import read_local
from areal_fn.runtime.hf.io import INDEX, SINGLE, HfCheckpoint, write_hf_checkpoint
from areal_fn.runtime.hf.load_into import hf_views, load_into
from tests.laws.test_convert_into import assert_bitwise, poisoned_like

transformers = pytest.importorskip("transformers")

SPECS = Path(__file__).resolve().parents[2] / "specs" / "models"
PUBLISHED = ("Qwen3.5-27B.json", "Qwen3.5-35B-A3B.json")
#: the fake multi-token-prediction tensors added (name, shape for hidden 16)
MTP = (("mtp.fc.weight", (16, 32)), ("mtp.layers.0.input_layernorm.weight", (16,)))


def tiny_published(name: str) -> dict[str, Any]:
    """The published config ``name`` shrunk: text and vision model a few hundred weights."""
    c = json.loads((SPECS / name).read_text())
    t = c["text_config"]
    t.update(
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=40,
        eos_token_id=0,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=4,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=3,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        dtype="float32",
    )
    if "num_experts" in t:
        del t["intermediate_size"]
        t.update(
            num_experts=3,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=10,
        )
    c["vision_config"].update(
        depth=1,
        hidden_size=16,
        intermediate_size=16,
        num_heads=2,
        out_hidden_size=16,
        num_position_embeddings=16,
        patch_size=2,
    )
    c["dtype"] = "float32"
    return c


def _add_mtp(path: Path) -> dict[str, torch.Tensor]:
    """Write :data:`MTP` tensors into the checkpoint at ``path`` (into its one file, or a
    file of their own named by the index); the tensors written."""
    g = torch.Generator().manual_seed(3)
    mtp = {n: torch.randn(s, generator=g) for n, s in MTP}
    if (path / INDEX).exists():
        save_file(mtp, str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
        index = json.loads((path / INDEX).read_text())
        index["weight_map"].update(dict.fromkeys(mtp, "model-mtp.safetensors"))
        (path / INDEX).write_text(json.dumps(index))
    else:
        held = load_file(path / SINGLE)
        save_file({**held, **mtp}, str(path / SINGLE), metadata={"format": "pt"})
    return mtp


@pytest.fixture(scope="module", params=PUBLISHED)
def published(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    c = tiny_published(request.param)
    config = transformers.CONFIG_MAPPING[c["model_type"]](
        **{k: v for k, v in c.items() if k != "model_type"}
    )
    torch.manual_seed(0)
    model = getattr(transformers, c["architectures"][0])(config).eval()
    path = tmp_path_factory.mktemp("mm") / "hf"
    moe = "num_experts" in c["text_config"]
    model.save_pretrained(path, max_shard_size="20KB" if moe else "50MB")
    assert (path / INDEX).exists() == moe  # one sharded, one single file
    mtp = _add_mtp(path)
    spec = model_from_hf_config(path)
    inner = {f"model.{k}": v for k, v in model.model.language_model.state_dict().items()}
    text = hf_state_to_canonical({**inner, "lm_head.weight": model.lm_head.weight}, spec)
    visual = [f"model.visual.{k}" for k in model.model.visual.state_dict()]
    return path, model, spec, text, (*visual, *mtp)


def test_the_reader_reads_the_text_model_bitwise(published) -> None:
    path, _, spec, text, others = published
    files: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        files.update(load_file(f))
    assert sorted(spec.tensor_names) == sorted(text)
    with HfCheckpoint(path) as ckpt:
        with pytest.raises(ConversionError, match=r"tensors that are not the text model"):
            ckpt.check(spec)
        assert sorted(ckpt.check(spec, text_only=True)) == sorted(others)
        for name, want in text.items():
            stored = name.replace("model.", "model.language_model.", 1)
            assert torch.equal(ckpt.read_full(name), want), name
            assert torch.equal(ckpt.read_full(name), files[stored]), name
            assert ckpt.shape(name) == tuple(want.shape)
    views = hf_views(path)
    assert sorted(views) == sorted([*text, *others])


@pytest.mark.parametrize("alloc", ["fsdp:d2", "sglang:t2"])
def test_load_into_fills_a_layout_from_the_published_names(published, alloc) -> None:
    path, _, spec, text, _ = published
    layout = layout_for(spec, alloc)
    for rank in range(layout.world_size):
        want = to_megatron(text, layout, rank)
        out = poisoned_like(want)
        with pytest.raises(ConversionError, match=r"pass text_only=True"):
            load_into(path, layout, rank, out=out)
        load_into(path, layout, rank, out=out, text_only=True)
        assert_bitwise(out, want)


def test_the_text_model_we_read_gives_the_multimodal_logits(published, tmp_path) -> None:
    path, model, spec, _, _ = published
    with HfCheckpoint(path) as ckpt:
        ckpt.check(spec, text_only=True)
        state = {n: ckpt.read_full(n) for n in spec.tensor_names}
    text_config = model.config.text_config.to_dict()
    write_hf_checkpoint(tmp_path / "text", state, config=text_config, model=spec)
    cls = getattr(transformers, spec.family.architecture)  # Qwen3_5(Moe)ForCausalLM
    causal = cls.from_pretrained(tmp_path / "text", dtype=torch.float32).eval()
    ids = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = causal(input_ids=ids).logits
    assert torch.equal(got, want)


def test_convert_text_only_lists_what_it_left_out_and_round_trips(
    published, tmp_path, capsys
) -> None:
    path, _, spec, text, others = published
    ranks, back = tmp_path / "ranks", tmp_path / "back"
    assert main(["convert", str(path), "fsdp:d2", str(ranks), "--text-only", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    n_visual = sum(1 for n in others if n.startswith("model.visual."))
    assert [x for x in doc["not_carried"] if "not the text model" in x] == [
        f"model.visual.* (the vision encoder, {n_visual} tensors: not the text model, left "
        "out as asked)",
        f"mtp.* (the multi-token-prediction layers, {len(MTP)} tensors: not the text model, "
        "left out as asked)",
    ]
    layout = layout_for(spec, "fsdp:d2")
    for r in range(layout.world_size):
        got, want = read_local(ranks / f"rank{r:05d}.safetensors"), to_megatron(text, layout, r)
        assert_bitwise({n: got[n] for n in want}, want)
        assert sorted(got) == sorted(want)
    assert main(["convert", str(ranks), str(back), "--to-hf"]) == 0
    capsys.readouterr()
    with HfCheckpoint(back) as hf:
        assert sorted(hf.stored) == sorted(text)  # canonical names, as the text model saves
        for name, t in text.items():
            assert torch.equal(hf.read_full(name), t), name
    cls = getattr(transformers, spec.family.architecture)  # the text model loads it whole
    _, info = cls.from_pretrained(back, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
