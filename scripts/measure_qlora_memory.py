"""The frozen base's memory with `model.quantize` (QLoRA) against bfloat16, on CPU.

A random-init Llama of the given shape is saved in bfloat16 (save_pretrained), then loaded three
ways: bfloat16, `int8` and `nf4`, each with the quantization `dptrain.models.hf` trains with
(`quantization_config`). For each it reports `dptrain.models.hf.stored_bytes` (parameters,
buffers and the quantization scales, each tensor once) of the whole model and of its Linear
layers inside the decoder blocks (what quantization stores in 8 or 4 bits; the embeddings and
the output layer stay in bfloat16), no adapters. Needs the [hf] and [quantize] extras.

    python scripts/measure_qlora_memory.py --hidden 1024 --layers 8 --vocab 32000
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dptrain.models.hf import quantization_config, stored_bytes

MIB = 2**20


def save_llama(folder: Path, hidden: int, layers: int, vocab: int) -> dict[str, int]:
    """A random-init Llama (intermediate size 11/4 of `hidden`, heads of 64, untied output
    layer, as Llama 2) saved in bfloat16 in `folder`; its shape."""
    import transformers

    shape = dict(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                 num_attention_heads=max(hidden // 64, 1), num_key_value_heads=max(hidden // 64, 1),
                 vocab_size=vocab)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, tie_word_embeddings=False))
    model.to(torch.bfloat16).save_pretrained(folder)
    return shape


def _block_linears(model: nn.Module) -> nn.ModuleList:
    """The Linear layers (quantized or not) inside the decoder blocks."""
    return nn.ModuleList(m for name, m in model.named_modules()
                         if ".layers." in name and isinstance(m, nn.Linear))


def measure(folder: Path, quantize: str | None) -> dict[str, Any]:
    """Bytes of the model loaded from `folder` in bfloat16, quantized by `quantize` or not."""
    import transformers

    extra = {} if quantize is None else {
        "quantization_config": quantization_config(quantize, "bfloat16"), "device_map": {"": "cpu"}}
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **extra)
    linears = _block_linears(model)
    return {"model_bytes": stored_bytes(model), "block_linear_bytes": stored_bytes(linears),
            "block_linear_weights": sum(m.in_features * m.out_features for m in linears)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        shape = save_llama(Path(tmp), args.hidden, args.layers, args.vocab)
        rows = {name: measure(Path(tmp), q) for name, q in
                (("bfloat16", None), ("int8", "int8"), ("nf4", "nf4"))}
    base = rows["bfloat16"]
    print(f"Llama {shape}, {base['block_linear_weights']:,} weights in the blocks' Linear layers")
    print("| base | whole model | blocks' Linear layers | bytes a block weight |")
    print("| --- | --- | --- | --- |")
    for name, row in rows.items():
        row["model_ratio"] = row["model_bytes"] / base["model_bytes"]
        row["block_linear_ratio"] = row["block_linear_bytes"] / base["block_linear_bytes"]
        print(f"| {name} | {row['model_bytes'] / MIB:.1f} MiB ({row['model_ratio']:.0%}) | "
              f"{row['block_linear_bytes'] / MIB:.1f} MiB ({row['block_linear_ratio']:.0%}) | "
              f"{row['block_linear_bytes'] / row['block_linear_weights']:.3f} |")
    result = {"shape": shape, **rows}
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
