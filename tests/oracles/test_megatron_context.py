"""Context parallelism's chunk order against Megatron-Core's own code (one process).

- :func:`~areal_fn.plans.context.context_chunks` gives each CP rank the tokens that
  Megatron's ``get_batch_on_this_cp_rank`` gives it (ids and the rows of the attention
  mask), for every ``cp`` and length;
- :func:`~areal_fn.plans.context.context_gather_order` puts an all-gather of those
  slices back in sequence order;
- the CPU redirection of ``get_pos_emb_on_this_cp_rank`` selects the rotary rows the
  same function selects for the token ids;
- the refusals name the numbers.

Megatron reads the group's size and rank only once ``torch.distributed`` is initialised:
the tests stand a two-method group in and report it initialised.
"""

import importlib.util

import pytest

if importlib.util.find_spec("megatron") is None:
    pytest.skip("needs megatron-core", allow_module_level=True)

import torch
import torch.distributed

from areal_fn.errors import PlanError
from areal_fn.plans.context import check_context_split, context_chunks, context_gather_order


class _Group:
    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.fixture
def megatron_batch_split(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    from megatron.core.utils import get_batch_on_this_cp_rank

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    return get_batch_on_this_cp_rank


CASES = [(cp, seq) for cp in (1, 2, 3, 4) for seq in (2 * cp, 4 * cp, 6 * cp, 48)]


@pytest.mark.parametrize(("cp", "seq"), CASES)
def test_chunks_are_megatrons(megatron_batch_split, cp: int, seq: int) -> None:  # type: ignore[no-untyped-def]
    ids = torch.arange(seq).unsqueeze(0)
    mask = torch.arange(seq * seq).reshape(1, 1, seq, seq)
    slices = []
    for rank in range(cp):
        got = megatron_batch_split(
            {"tokens": ids.clone(), "attention_mask": mask.clone()}, cp_group=_Group(cp, rank)
        )
        ours = torch.cat([torch.arange(lo, hi) for lo, hi in context_chunks(seq, cp=cp, rank=rank)])
        assert torch.equal(got["tokens"][0], ours)
        assert torch.equal(got["attention_mask"], mask[:, :, ours])  # the query rows
        slices.append(got["tokens"])
    if cp > 1:  # an all-gather of the slices, back in sequence order
        gathered = torch.cat(slices, dim=1).chunk(2 * cp, dim=1)
        restored = torch.cat([gathered[i] for i in context_gather_order(cp)], dim=1)
        assert torch.equal(restored[0], torch.arange(seq))


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_cpu_rotary_slice_matches_the_token_slice(megatron_batch_split, cp: int) -> None:  # type: ignore[no-untyped-def]
    from areal_fn.runtime.megatron.cpu import _cpu_pos_emb_on_this_cp_rank

    seq, dim = 8 * cp, 6
    emb = torch.randn(seq, 1, 1, dim)  # RotaryEmbedding's [T, 1, 1, d]
    for rank in range(cp):
        want = megatron_batch_split({"x": emb.transpose(0, 1).clone()}, cp_group=_Group(cp, rank))
        got = _cpu_pos_emb_on_this_cp_rank(emb, 0, _Group(cp, rank))
        assert torch.equal(got, want["x"].transpose(0, 1))


def test_context_split_refusals() -> None:
    with pytest.raises(
        PlanError,
        match=r"^sequence length 18 does not split into 2\*cp=4 equal chunks \(context "
        r"parallelism gives rank r chunks r and 3-r\); pass rows of a multiple of 4 tokens "
        r"\(e\.g\. 20, the extra tokens masked\), or pack sequences",
    ):
        check_context_split(18, 2)
    with pytest.raises(PlanError, match=r"^cp=0 must be >= 1$"):
        check_context_split(8, 0)
    with pytest.raises(PlanError, match=r"^sequence length 0 must be >= 1$"):
        context_chunks(0, cp=1, rank=0)
    with pytest.raises(PlanError, match=r"^rank=2 must lie in 0\.\.1 \(cp=2\)$"):
        context_chunks(8, cp=2, rank=2)
    assert context_chunks(7, cp=1, rank=0) == ((0, 7),)
    assert context_chunks(8, cp=2, rank=1) == ((2, 4), (4, 6))


def test_packed_mask_is_transformers_packed_mask() -> None:
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("needs transformers")
    from inspect import signature

    from transformers import AutoConfig
    from transformers.masking_utils import create_causal_mask

    from areal_fn.runtime.engines.megatron_packing import segment_mask

    cfg = AutoConfig.for_model("qwen2", hidden_size=32, num_attention_heads=4)
    cfg._attn_implementation = "eager"
    pos = torch.cat([torch.arange(n) for n in (4, 1, 6, 3)]).unsqueeze(0)
    # the cache argument is ``past_key_values`` before transformers 5.20, ``cache`` after
    no_cache = {
        name: None
        for name in ("cache", "past_key_values")
        if name in signature(create_causal_mask).parameters
    }
    mask = create_causal_mask(
        config=cfg,
        inputs_embeds=torch.zeros(1, pos.shape[1], 32),
        attention_mask=None,
        position_ids=pos,
        **no_cache,
    )
    assert mask is not None and mask.shape == (1, 1, 14, 14)
    assert torch.equal(segment_mask(pos[0]), mask != 0)  # Megatron's True = masked out


def test_packed_micro_batches_share_one_width() -> None:
    from areal_fn.runtime.engines.megatron_packing import packed_micro_batches, unpack_logprobs
    from areal_fn.runtime.engines.packed import TokenSequence

    lengths = (16, 5, 9, 3, 7)
    seqs = [TokenSequence(input_ids=torch.arange(n) + 1) for n in lengths]
    micro, rows = packed_micro_batches(seqs, max_tokens=16, multiple_of=4)
    assert len(rows) == 3 and {m[0].shape for m in micro} == {(1, 16)}
    for (ids, _, counted, weights, attention), row in zip(micro, rows, strict=True):
        real = sum(lengths[i] for i in row.sequences)
        assert not ids[0, real:].any() and not counted[0, real:].any()
        assert not weights[0, real:].any()
        assert attention.shape == (1, 1, 16, 16)
        if real < 16:  # the padding sees only padding, and no real token sees it
            assert attention[0, 0, real:, :real].all() and attention[0, 0, :real, real:].all()
    per_row = [targets.float() for _, targets, _, _, _ in micro]  # stands in for log-probs
    back = unpack_logprobs(rows, per_row, lengths)
    for seq, got in zip(seqs, back, strict=True):
        assert torch.equal(got, seq.input_ids[1:].float())  # each sequence's next tokens


def test_context_parallel_refusals() -> None:
    from types import SimpleNamespace

    from areal_fn.errors import LayoutError
    from areal_fn.runtime.engines.megatron_steps import MegatronSteps
    from areal_fn.runtime.engines.packed import TokenSequence
    from areal_fn.runtime.megatron.build import MegatronSizes, transformer_config
    from areal_fn.runtime.megatron.context import _refuse, context_parallel_attention
    from areal_fn.strategy.allocation import ParallelDims

    config = SimpleNamespace(
        context_parallel_size=2,
        attention_dropout=0.1,
        apply_query_key_layer_scaling=False,
        window_size=(4, 0),
        softmax_type="vanilla",
    )
    with pytest.raises(
        LayoutError,
        match=r"^context-parallel core attention \(cp=2\) computes plain causal softmax "
        r"attention; the config asks for \{'attention_dropout': 0\.1, 'window_size': \(4, 0\)\}; "
        r"use cp=1 or Transformer Engine's attention for these$",
    ):
        _refuse(config, None)
    arch = {
        "hidden_size": 16,
        "num_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 16,
        "vocab_size": 8,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e4,
    }
    attention = context_parallel_attention()(
        transformer_config(arch, MegatronSizes(cp=2)),
        1,
        None,
        "self",
        pg_collection=SimpleNamespace(cp=None),
    )
    q = torch.zeros(4, 1, 2, 8)
    with pytest.raises(LayoutError, match=r"^the context-parallel core attention takes padded"):
        attention(q, q, q, None, packed_seq_params=object())
    steps = MegatronSteps.__new__(MegatronSteps)  # what _packed reads, no process group
    steps.dims, steps._te_cp = ParallelDims(cp=2), True
    steps.spec = SimpleNamespace(linear_attention=None)  # a model without linear attention
    with pytest.raises(
        LayoutError,
        match=r"^packed sequences under cp=2 with Transformer Engine's attention: its causal "
        r"kernel does not read the block-diagonal mask; pass padded rows \(train_step\)",
    ):
        steps._packed([TokenSequence(input_ids=torch.arange(4))], 8)
