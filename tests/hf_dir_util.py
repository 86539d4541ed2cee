"""An HF model directory with what real ones hold besides weights, for the carry-through tests.

:func:`add_hf_extras` gives a directory a ``config.json`` with keys the model spec does
not model (Llama 3.1's eos list, token ids, a nested custom key; indented with 4
spaces, keys unsorted, so only a byte-for-byte copy stays equal), a real tokenizer
(``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja`` written by
transformers), ``special_tokens_map.json``, a binary ``tokenizer.model``,
``generation_config.json`` and a README, plus things that must not be carried: a stale
``pytorch_model.bin``, a subdirectory and a hidden file.
"""

import json
from pathlib import Path

#: What the directory holds that is not carried.
NOT_CARRIED = (".gitattributes", "original", "pytorch_model.bin")


def add_hf_extras(path: Path, config: dict[str, object]) -> dict[str, bytes]:
    """Write ``config`` (plus extra keys) and the extra files into ``path``; the carried files."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    extra = {
        "eos_token_id": [128001, 128008, 128009],
        "bos_token_id": 128000,
        "pad_token_id": None,
        "hidden_act": "silu",
        "transformers_version": "4.43.0.dev0",
        "custom_field": {"nested": [1, 2.5, "x"], "flag": True},
    }
    full = {**extra, **{k: v for k, v in config.items() if k not in extra}}
    (path / "config.json").write_text(json.dumps(full, indent=4))
    tok = Tokenizer(
        models.WordLevel(vocab={"[UNK]": 0, "hello": 1, "world": 2, "<eos>": 3}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>"
    )
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}<eos>{% endfor %}"
    fast.save_pretrained(path)
    (path / "special_tokens_map.json").write_text('{"eos_token": "<eos>", "unk_token": "[UNK]"}')
    (path / "tokenizer.model").write_bytes(bytes(range(256)) * 3)
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [128001, 128009], "temperature": 0.6, "top_p": 0.9})
    )
    (path / "README.md").write_text("# tiny\n")
    (path / "pytorch_model.bin").write_bytes(b"stale weights")
    (path / "original").mkdir()
    (path / "original" / "params.json").write_text("{}")
    (path / ".gitattributes").write_text("*.bin filter=lfs\n")
    return {
        p.name: p.read_bytes()
        for p in sorted(path.iterdir())
        if p.is_file()
        and p.name not in NOT_CARRIED
        and not p.name.endswith(".safetensors")
        and not p.name.endswith(".index.json")
    }
