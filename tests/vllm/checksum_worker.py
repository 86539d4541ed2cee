"""vLLM's checksums of an HF checkpoint it loads itself (an offline engine at TP ``--tp``)."""

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from vllm import LLM

    llm = LLM(
        model=args.model,
        tensor_parallel_size=args.tp,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        skip_tokenizer_init=True,
    )
    merged: dict[str, str] = {}
    for part in llm.collective_rpc("compute_weight_checksums"):
        merged.update(part)
    Path(args.out).write_text(json.dumps(merged))
    return 0


if __name__ == "__main__":
    sys.exit(main())
