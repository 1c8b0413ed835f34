"""Writes tests/data/hf_tiny_gpt2.safetensors with Python's own safetensors package,
laid out as Hugging Face saves a GPT2LMHeadModel: "transformer."-prefixed names,
Conv1D weights [in, out], the attention-mask buffers h.{i}.attn.bias, a tied
lm_head.weight, and {"format": "pt"} metadata. tests/test_gpt.cpp loads it and
checks every value against the same formula.

Config (tests/test_gpt.cpp's `tiny`): 2 layers, d_model 16, 2 heads, vocab 37,
max_seq 8. Regenerate with:  pip install safetensors numpy && python3 tests/data/make_hf_fixture.py
"""
import os

import numpy as np
from safetensors.numpy import save_file

L, C, V, T = 2, 16, 37, 8


def values(tensor_index, shape):
    # the formula tests/test_gpt.cpp repeats: computed in float64, stored as float32
    k = np.arange(int(np.prod(shape)), dtype=np.float64)
    return ((k % 97) * 0.01 - 0.48 + 0.001 * tensor_index).astype(np.float32).reshape(shape)


shapes = [("wte.weight", (V, C)), ("wpe.weight", (T, C))]
for i in range(L):
    shapes += [
        (f"h.{i}.ln_1.weight", (C,)), (f"h.{i}.ln_1.bias", (C,)),
        (f"h.{i}.attn.c_attn.weight", (C, 3 * C)), (f"h.{i}.attn.c_attn.bias", (3 * C,)),
        (f"h.{i}.attn.c_proj.weight", (C, C)), (f"h.{i}.attn.c_proj.bias", (C,)),
        (f"h.{i}.ln_2.weight", (C,)), (f"h.{i}.ln_2.bias", (C,)),
        (f"h.{i}.mlp.c_fc.weight", (C, 4 * C)), (f"h.{i}.mlp.c_fc.bias", (4 * C,)),
        (f"h.{i}.mlp.c_proj.weight", (4 * C, C)), (f"h.{i}.mlp.c_proj.bias", (C,)),
    ]
shapes += [("ln_f.weight", (C,)), ("ln_f.bias", (C,))]

tensors = {"transformer." + name: values(t, shape) for t, (name, shape) in enumerate(shapes)}
for i in range(L):  # HF's causal-mask buffer, not a parameter
    tensors[f"transformer.h.{i}.attn.bias"] = np.tril(np.ones((T, T), dtype=np.float32)).reshape(1, 1, T, T)
tensors["lm_head.weight"] = tensors["transformer.wte.weight"].copy()  # tied

out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_tiny_gpt2.safetensors")
save_file(tensors, out, metadata={"format": "pt"})
print(out, os.path.getsize(out), "bytes")
