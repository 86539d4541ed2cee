"""Our attention function and packed rows against transformers itself (one process).

- the mask :func:`~areal_fn.runtime.engines.ulysses.segment_mask` builds from
  ``position_ids`` equals the eager mask transformers' ``create_causal_mask`` makes for
  the same packed positions;
- a model running :func:`~areal_fn.runtime.engines.ulysses.ulysses_attention` (no
  sequence parallelism) on packed rows gives, token for token, the logits of the plain
  eager transformers model run on each sequence alone;
- :func:`~areal_fn.runtime.engines.packed.pack_rows` gives each token the next token of
  its own sequence as target, and the last token of a sequence and padding none.
"""

import importlib.util

import pytest

if importlib.util.find_spec("transformers") is None:
    pytest.skip("needs transformers", allow_module_level=True)

import copy

import torch

from areal_fn.errors import LayoutError, SpecError
from areal_fn.model.spec import model_from_hf_config
from areal_fn.runtime.engines import ulysses
from areal_fn.runtime.engines.fsdp2 import build_hf_model
from areal_fn.runtime.engines.packed import TokenSequence, full_row_targets, pack_rows

CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 50,
    "torch_dtype": "float32",
}
LENGTHS = (7, 3, 12, 5, 9, 2)


def _sequences(vocab: int) -> list[TokenSequence]:
    gen = torch.Generator().manual_seed(0)
    return [
        TokenSequence(
            input_ids=torch.randint(0, vocab, (n,), generator=gen),
            loss_mask=torch.arange(n) >= 1,
            weights=torch.rand(n, generator=gen, dtype=torch.float32),
        )
        for n in LENGTHS
    ]


def test_segment_mask_is_transformers_packed_mask() -> None:
    from inspect import signature

    from transformers import AutoConfig
    from transformers.masking_utils import create_causal_mask

    cfg = AutoConfig.for_model("qwen2", **{k: v for k, v in CONFIG.items() if k != "model_type"})
    cfg._attn_implementation = "eager"
    pos = torch.cat([torch.arange(n) for n in (4, 1, 6, 3)]).unsqueeze(0)
    embeds = torch.zeros(1, pos.shape[1], 32)
    # the cache argument is ``past_key_values`` before transformers 5.20, ``cache`` after
    no_cache = {
        name: None
        for name in ("cache", "past_key_values")
        if name in signature(create_causal_mask).parameters
    }
    mask = create_causal_mask(
        config=cfg, inputs_embeds=embeds, attention_mask=None, position_ids=pos, **no_cache
    )
    assert mask is not None and mask.shape == (1, 1, 14, 14)
    assert torch.equal(ulysses.segment_mask(pos), (mask[:, 0] == 0))


@pytest.mark.parametrize("multiple_of", [1, 4])
def test_packed_rows_equal_sequences_one_by_one(multiple_of: int) -> None:
    spec = model_from_hf_config(CONFIG)
    plain = build_hf_model(spec, seed=3).eval()
    ours = copy.deepcopy(plain)
    ulysses.install(ours, None)
    seqs = _sequences(spec.vocab_size)
    rows = pack_rows(seqs, max_tokens=16, multiple_of=multiple_of)
    assert len(rows) < len(seqs)  # some rows hold several sequences
    with torch.no_grad():
        for row in rows:
            assert row.input_ids.shape[1] % multiple_of == 0
            logits = ours(
                input_ids=row.input_ids, position_ids=row.position_ids, use_cache=False
            ).logits[0]
            for i, start in zip(row.sequences, row.offsets, strict=True):
                alone = plain(input_ids=seqs[i].input_ids[None]).logits[0]
                got = logits[start : start + len(seqs[i])]
                torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)


def test_packed_targets_stay_inside_their_sequence() -> None:
    seqs = _sequences(50)
    rows = pack_rows(seqs, max_tokens=16, multiple_of=4)
    covered = []
    for row in rows:
        n_real = sum(len(seqs[i]) for i in row.sequences)
        assert not row.counted[0, n_real:].any() and not row.weights[0, n_real:].any()
        for i, start in zip(row.sequences, row.offsets, strict=True):
            s, n = seqs[i], len(seqs[i])
            assert torch.equal(row.input_ids[0, start : start + n], s.input_ids)
            assert torch.equal(row.position_ids[0, start : start + n], torch.arange(n))
            assert torch.equal(row.targets[0, start : start + n - 1], s.input_ids[1:])
            assert s.loss_mask is not None and s.weights is not None
            assert torch.equal(row.counted[0, start : start + n - 1], s.loss_mask[1:])
            assert not row.counted[0, start + n - 1]
            torch.testing.assert_close(
                row.weights[0, start : start + n - 1], s.weights[1:] * s.loss_mask[1:]
            )
            covered.append(i)
    assert sorted(covered) == list(range(len(seqs)))


def test_full_row_targets() -> None:
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    mask = torch.tensor([[True, False, True], [True, True, True]])
    row = full_row_targets(ids, mask)
    assert torch.equal(row.targets[:, :-1], ids[:, 1:])
    assert torch.equal(row.counted[:, :-1], mask[:, 1:]) and not row.counted[:, -1].any()
    assert torch.equal(row.position_ids, torch.tensor([[0, 1, 2], [0, 1, 2]]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"input_ids": torch.tensor([1])},
            r"^TokenSequence.input_ids has shape \(1,\) and dtype torch.int64; give a 1-D "
            r"integer tensor of at least 2 tokens$",
        ),
        (
            {"input_ids": torch.tensor([[1, 2]])},
            r"input_ids has shape \(1, 2\)",
        ),
        (
            {"input_ids": torch.tensor([1, 2]), "loss_mask": torch.tensor([1, 0])},
            r"^TokenSequence.loss_mask has shape \(2,\) and dtype torch.int64; it needs "
            r"input_ids' shape \(2,\) and a dtype in \(torch.bool,\)$",
        ),
        (
            {"input_ids": torch.tensor([1, 2]), "weights": torch.ones(3)},
            r"^TokenSequence.weights has shape \(3,\)",
        ),
    ],
)
def test_token_sequence_refusals(kwargs: dict[str, torch.Tensor], match: str) -> None:
    with pytest.raises(SpecError, match=match):
        TokenSequence(**kwargs)


def test_attention_refuses_a_model_it_was_not_installed_in() -> None:
    spec = model_from_hf_config(CONFIG)
    model = build_hf_model(spec, seed=0)
    model.config._attn_implementation = ulysses.ATTENTION
    ulysses.install(build_hf_model(spec, seed=0), None)  # registers the function
    with pytest.raises(LayoutError, match=r"^Qwen2Attention has no sequence-parallel group; "):
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
