"""load_into / hf_views against real transformers checkpoints and real safetensors files.

``save_pretrained`` (sharded) writes the checkpoints; safetensors' own ``load_file``
and transformers' state dict are the oracles for what the files hold, and the existing
path (``to_megatron`` over ``HfCheckpoint.read``) for what a rank's tensors are.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from areal_fn import ConversionError, ParallelDims, megatron_layout, model_from_hf_config
from areal_fn.layouts.fsdp2 import fsdp2_layout
from areal_fn.layouts.inference import inference_layout
from areal_fn.model.hf_memory import hf_state_to_canonical
from areal_fn.plans.convert import to_megatron
from areal_fn.runtime.hf.io import INDEX, HfCheckpoint
from areal_fn.runtime.hf.load_into import hf_views, load_into
from areal_fn.sharding.shard import as_bytes
from tests.laws.test_convert_into import assert_bitwise, poisoned_like
from tests.oracles.test_hf_io import CONFIGS, real_model

LAYOUTS = {
    "megatron-t2": lambda s: megatron_layout(s, ParallelDims(tp=2)),
    "megatron-t2p2": lambda s: megatron_layout(s, ParallelDims(tp=2, pp=2)),
    "fsdp2-d2t2": lambda s: fsdp2_layout(s, ParallelDims(dp=2, tp=2)),
    "inference-t2": lambda s: inference_layout(s, ParallelDims(tp=2)),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    model, _ = real_model(request.param)
    path = tmp_path_factory.mktemp(request.param) / "hf"
    model.save_pretrained(path, max_shard_size="20KB")
    spec = model_from_hf_config(path)
    return path, spec, hf_state_to_canonical(model.state_dict(), spec)


def test_views_are_what_safetensors_loads(checkpoint):
    path, spec, canon = checkpoint
    assert (path / INDEX).exists()
    views = hf_views(path)
    files = {}
    for f in sorted(path.glob("*.safetensors")):
        files.update(load_file(f))
    assert sorted(views) == sorted(files) == sorted(canon)
    for name, v in views.items():
        assert v.dtype == files[name].dtype and torch.equal(as_bytes(v), as_bytes(files[name]))
        assert torch.equal(as_bytes(v), as_bytes(canon[name]))
    name = spec.tensors[0].name
    views[name].view(-1)[0] += 1  # copy-on-write: the file keeps its bytes
    assert torch.equal(hf_views(path)[name], canon[name])


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_load_into_writes_what_the_reader_path_builds(checkpoint, layout_name):
    path, spec, canon = checkpoint
    layout = LAYOUTS[layout_name](spec)
    with HfCheckpoint(path) as ckpt:
        for rank in range(layout.world_size):
            want = to_megatron(ckpt.read, layout, rank)
            assert_bitwise(want, to_megatron(canon, layout, rank))  # transformers' weights
            out = poisoned_like(want)
            written = load_into(path, layout, rank, out=out)
            assert_bitwise(out, want)
            assert written == sum(t.numel() * t.element_size() for t in want.values())


def test_cast_into_bfloat16_parameters(checkpoint):
    path, spec, canon = checkpoint
    layout = megatron_layout(spec, ParallelDims(tp=2))
    want = {k: v.to(torch.bfloat16) for k, v in to_megatron(canon, layout, 1).items()}
    out = poisoned_like(want)
    with pytest.raises(ConversionError, match=r"is torch.float32, the destination torch.bfloat16"):
        load_into(path, layout, 1, out=out)
    load_into(path, layout, 1, out=out, cast=True)
    assert_bitwise(out, want)


def test_a_dtensor_destination_is_refused(checkpoint):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    path, spec, canon = checkpoint
    layout = megatron_layout(spec, ParallelDims())
    out = poisoned_like(to_megatron(canon, layout, 0))
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        name = next(iter(out))
        out[name] = distribute_tensor(out[name], init_device_mesh("cpu", (1,)))
        with pytest.raises(
            ConversionError,
            match=rf"destinations \['{name}'\] are DTensors, whose shape is the global one; "
            r"pass each one's local shard \(t.to_local\(\)\)",
        ):
            load_into(path, layout, 0, out=out)
    finally:
        dist.destroy_process_group()


def test_checkpoints_that_do_not_fit_are_refused(tmp_path, checkpoint):
    path, spec, canon = checkpoint
    layout = megatron_layout(spec, ParallelDims(tp=2))
    out = poisoned_like(to_megatron(canon, layout, 0))
    before = {k: v.clone() for k, v in out.items()}
    # an index naming, for a tensor, a file that does not hold it
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in path.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    index = json.loads((bad / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    moved = next(n for n, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][moved] = files[1]
    (bad / INDEX).write_text(json.dumps(index))
    with pytest.raises(
        ConversionError,
        match=rf"names files that do not hold the tensors it maps to them: \['{moved} "
        rf"\({files[1]}\)'\]; the checkpoint is inconsistent",
    ):
        load_into(bad, layout, 0, out=out)
    # a checkpoint of another model (one tensor short)
    other = tmp_path / "other"
    other.mkdir()
    save_file(
        {k: v for k, v in canon.items() if k != "model.norm.weight"}, other / "model.safetensors"
    )
    with pytest.raises(
        ConversionError, match=r"canonical tensors do not match the model: missing 1"
    ):
        load_into(other, layout, 0, out=out)
    assert all(torch.equal(as_bytes(out[k]), as_bytes(v)) for k, v in before.items())


@pytest.mark.parametrize("threads", [1, 3])
def test_any_number_of_reading_threads_writes_the_same(checkpoint, threads):
    path, spec, canon = checkpoint
    layout = megatron_layout(spec, ParallelDims(tp=2, pp=2))
    for rank in range(layout.world_size):
        want = to_megatron(canon, layout, rank)
        out = poisoned_like(want)
        load_into(path, layout, rank, out=out, threads=threads)
        assert_bitwise(out, want)


def test_no_reading_thread_is_refused(checkpoint):
    path, spec, canon = checkpoint
    layout = megatron_layout(spec, ParallelDims(tp=2))
    out = poisoned_like(to_megatron(canon, layout, 0))
    with pytest.raises(ConversionError, match=r"threads=0 must be >= 1 \(or None"):
        load_into(path, layout, 0, out=out, threads=0)
