"""Fsdp2Engine.load_canonical writes an HF checkpoint straight into its shards.

One process (world size 1, gloo): the engine starts from its own seeded weights; after
``load_canonical(mapping_reader(hf_views(path)))`` of a checkpoint transformers'
``save_pretrained`` wrote, the engine exports exactly what safetensors' ``load_file``
reads from those files.
"""

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from areal_fn import ParallelDims, model_from_hf_config
from areal_fn.plans.convert import mapping_reader
from areal_fn.runtime.hf.load_into import hf_views
from areal_fn.sharding.shard import as_bytes
from tests.oracles.test_hf_io import CONFIGS, real_model


@pytest.fixture
def one_process():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fsdp2_engine_loads_a_checkpoint_reader_into_its_shards(tmp_path, name, one_process):
    from areal_fn.runtime.engines.fsdp2 import Fsdp2Engine

    model, _ = real_model(name)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # other weights than the engine's seeded ones
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    model.save_pretrained(tmp_path)
    files = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        files.update(load_file(f))
    engine = Fsdp2Engine(model_from_hf_config(tmp_path), ParallelDims())
    before = engine.export_canonical()
    assert any(not torch.equal(before[k], files[k]) for k in files)  # seeded, not loaded
    engine.load_canonical(mapping_reader(hf_views(tmp_path)))
    after = engine.export_canonical()
    assert sorted(after) == sorted(files)
    for k, want in files.items():
        assert after[k].dtype == want.dtype and torch.equal(as_bytes(after[k]), as_bytes(want)), k
