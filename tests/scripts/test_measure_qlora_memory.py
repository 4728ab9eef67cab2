"""Smoke test of scripts/measure_qlora_memory.py on a tiny Llama (the figures' arithmetic)."""

import json

import pytest
from script_loader import load_script

pytest.importorskip("bitsandbytes")
pytest.importorskip("transformers")


def test_the_blocks_weights_take_2_bytes_in_bf16_about_1_in_int8_and_a_half_in_nf4(tmp_path, capsys) -> None:
    out = tmp_path / "memory.json"
    result = load_script("measure_qlora_memory").main(
        ["--hidden", "64", "--layers", "1", "--vocab", "100", "--json", str(out)])
    assert "| nf4 |" in capsys.readouterr().out and json.loads(out.read_text()) == result
    per_weight = {name: result[name]["block_linear_bytes"] / result[name]["block_linear_weights"]
                  for name in ("bfloat16", "int8", "nf4")}
    assert per_weight["bfloat16"] == 2.0
    assert 1.0 < per_weight["int8"] <= 1.0 + 4 / 64          # + a float32 scale per row
    assert 0.5 + 4 / 64 <= per_weight["nf4"] < 0.6           # + a float32 absmax per 64 weights
    assert result["nf4"]["model_bytes"] < result["int8"]["model_bytes"] < result["bfloat16"]["model_bytes"]
