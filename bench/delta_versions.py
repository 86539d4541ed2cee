"""Successive weight versions from real AdamW steps, for the delta-sync benchmark.

A transformers model built from a config (random initial weights, no download), fp32
master weights, AdamW at an RL learning rate, a language-model loss on random tokens;
after each step the canonical tensors in bf16 (what an inference engine holds) are one
version. :func:`density` measures how many bf16 elements changed between two versions.
"""

from typing import Any

import attrs
import torch

from areal_fn.model.spec import ModelSpec

BATCH, SEQ = 2, 64


@attrs.frozen(kw_only=True)
class Versions:
    """The initial version and, per learning rate, the versions after each step."""

    initial: dict[str, torch.Tensor]
    after: dict[float, list[dict[str, torch.Tensor]]]
    step_seconds: float


def _model(spec: ModelSpec, seed: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = dict(spec.hf_config())
    config = AutoConfig.for_model(str(hf.pop("model_type")), **hf)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _bf16(model: torch.nn.Module, spec: ModelSpec) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return {c.name: state[c.name].detach().to(torch.bfloat16).clone() for c in spec.tensors}


def train_versions(spec: ModelSpec, lrs: tuple[float, ...], steps: int, seed: int = 0) -> Versions:
    """``steps`` AdamW steps from the same initial weights at each learning rate."""
    import time

    model = _model(spec, seed)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    initial = _bf16(model, spec)
    gen = torch.Generator().manual_seed(seed + 1)
    vocab = spec.vocab_size
    batches = [torch.randint(0, vocab, (BATCH, SEQ), generator=gen) for _ in range(steps)]
    after: dict[float, list[dict[str, torch.Tensor]]] = {}
    took = 0.0
    for lr in lrs:
        model.load_state_dict(start)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        after[lr] = []
        for ids in batches:
            t0 = time.perf_counter()
            opt.zero_grad()
            logits = model(input_ids=ids).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
            )
            loss.backward()
            opt.step()
            took += time.perf_counter() - t0
            after[lr].append(_bf16(model, spec))
    return Versions(initial=initial, after=after, step_seconds=took / (len(lrs) * steps))


def density(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Changed bf16 elements between two versions (bitwise), overall and in runs."""
    changed = total = runs = 0
    for name, a in old.items():
        mask = a.view(torch.int16).ne(new[name].view(torch.int16)).flatten()
        changed += int(torch.count_nonzero(mask))
        total += mask.numel()
        m = mask.to(torch.int8)
        runs += int(m[0]) + int(torch.count_nonzero(m[1:] > m[:-1]))
    return {"changed": changed, "total": total, "density": changed / total, "runs": runs}
