"""The demo's packed SP/CP phases, checked without torchrun: the data they train on, the
one-process reference they are held to (against transformers' own padded batch), and
the two checks they record, which must fail on wrong figures."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from areal_fn.model.demo import DEMO_CONFIG
from areal_fn.model.hf_memory import hf_state_to_canonical
from areal_fn.model.spec import model_from_hf_config
from areal_fn.runtime.demo import packed_phase as phase
from areal_fn.runtime.engines.fsdp2 import build_hf_model

SPEC = model_from_hf_config(DEMO_CONFIG)


def test_the_sequences_are_the_recurrence_with_a_masked_prompt_and_one_weight_each():
    samples = phase.packed_sequences(256, seed=77)
    again = phase.packed_sequences(256, seed=77)
    assert len(samples) == 12
    lengths = [len(ids) for ids, _, _ in samples]
    assert all(6 <= n <= 48 for n in lengths) and len(set(lengths)) > 6, lengths
    for (ids, mask, w), (ids2, mask2, w2) in zip(samples, again, strict=True):
        assert torch.equal(ids, ids2) and torch.equal(mask, mask2) and torch.equal(w, w2)
        assert ids.dtype == torch.int64 and all(
            int(b) == (5 * int(a) + 3) % 256 for a, b in itertools.pairwise(ids.tolist())
        )
        assert mask.tolist() == [False] * 3 + [True] * (len(ids) - 3)
        assert w.shape == ids.shape and len(set(w.tolist())) == 1 and 0.5 <= float(w[0]) < 1.5


def test_the_reference_equals_transformers_on_one_padded_batch():
    """The loss of the reference (each sequence alone) equals transformers' own batched
    forward over right-padded rows with an attention mask, and its gradients are
    clipped to CLIP."""
    model = build_hf_model(SPEC, seed=3)
    canonical = hf_state_to_canonical(
        {k: v.detach().clone() for k, v in model.state_dict().items()}, SPEC
    )
    samples = phase.packed_sequences(SPEC.vocab_size, seed=5, count=5)
    ref = phase.reference_step(SPEC, canonical, samples)

    width = max(len(ids) for ids, _, _ in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    attn = torch.zeros(len(samples), width, dtype=torch.long)
    counted = torch.zeros(len(samples), width, dtype=torch.bool)
    weights = torch.zeros(len(samples), width)
    for b, (x, m, w) in enumerate(samples):
        ids[b, : len(x)], attn[b, : len(x)] = x, 1
        counted[b, : len(x)], weights[b, : len(x)] = m, w
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1]
    ce = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    keep = counted[:, 1:]
    want = float((ce * weights[:, 1:] * keep).sum() / keep.sum())
    assert ref["tokens"] == int(keep.sum())
    assert ref["loss"] == pytest.approx(want, abs=1e-5)
    clipped = sum(float(g.double().square().sum()) for g in ref["grads"].values()) ** 0.5
    assert ref["norm"] > 0 and clipped == pytest.approx(min(ref["norm"], phase.CLIP), rel=1e-4)
    assert set(ref["grads"]) == set(SPEC.tensor_names)


def _ref() -> dict:
    g = torch.Generator().manual_seed(0)
    grads = {"a": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g)}
    return {"loss": 3.25, "tokens": 100, "norm": 2.0, "grads": grads}


def _first(ref: dict, *, loss: float = 0.0, norm: float = 0.0, grad: float = 0.0, tokens=0):
    grads = {k: v.clone() for k, v in ref["grads"].items()}
    grads["a"][1, 2] += grad
    stats = {"loss": ref["loss"] + loss, "grad_norm": ref["norm"] * (1 + norm)}
    stats["tokens"] = float(ref["tokens"] + tokens)
    return {"stats": stats, "grads": grads}


@pytest.mark.parametrize(
    ("change", "ok"),
    [
        ({}, True),
        ({"loss": 5e-6, "norm": 5e-6}, True),
        ({"loss": 2e-5}, False),
        ({"norm": 2e-5}, False),
        ({"tokens": 1}, False),
        ({"grad": 1e-3}, False),  # 1e-3 / max |g| (~2) is above 1e-5
    ],
)
def test_the_first_step_check_holds_the_law_tolerances(change, ok):
    ref = _ref()
    got: list = []
    phase._record_first_step(_first(ref, **change), ref, lambda *a: got.append(a), "CP")
    ((what, passed, figure),) = got
    assert what == "packed CP step = one process, one by one"
    assert passed is ok, figure
    assert figure.startswith("step 1 vs plain transformers: 100 targets; loss |diff| ")


# per rank: (data-parallel share, embedding token counts, attention token counts)
_GOOD = [(0, [30, 20], [30, 20]), (0, [30, 20], [30, 20]), (1, [31], [31]), (1, [31], [31])]


def test_the_tokens_check_accepts_half_of_every_row_on_both_ranks_of_a_share():
    ok, figure = phase._tokens_check(_GOOD, {0: 99, 1: 61}, cp=2, max_pad=2)
    assert ok, figure
    assert figure == (
        "ranks 0+1: 2 rows, 50 tokens each of 100 (99 + 1 padding); "
        "ranks 2+3: 1 row, 31 tokens each of 62 (61 + 1 padding)"
    )


@pytest.mark.parametrize(
    ("per_rank", "shares", "why"),
    [
        ([*_GOOD[:1], (0, [30, 21], [30, 21]), *_GOOD[2:]], {0: 99, 1: 61}, "other rows"),
        ([*_GOOD[:2], (1, [31], [30]), _GOOD[3]], {0: 99, 1: 61}, "attention saw other"),
        (_GOOD, {0: 101, 1: 61}, "fewer tokens than the share holds"),
        (_GOOD, {0: 90, 1: 61}, "more padding than rows need"),
        ([(0, [40], [40])] * 2 + _GOOD[2:], {0: 79, 1: 61}, "a row over the budget"),
        ([_GOOD[0], (1, [30, 20], [30, 20]), *_GOOD[2:]], {0: 99, 1: 61}, "shares of 1 and 3"),
        ([(0, [], [])] * 2 + _GOOD[2:], {0: 0, 1: 61}, "no forward ran"),
    ],
)
def test_the_tokens_check_refuses_what_is_not_an_even_split(per_rank, shares, why):
    ok, _ = phase._tokens_check(per_rank, shares, cp=2, max_pad=2)
    assert not ok, why
