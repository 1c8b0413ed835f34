"""Writes the Llama fixtures tests/test_llama.cpp pins fived's Llama to, from Hugging Face
`transformers` itself:

  hf_tiny_llama.safetensors      a random tiny LlamaForCausalLM with grouped-query attention
                                 and Llama 3.1 rotary scaling, as save_pretrained writes it
  hf_tiny_llama_ref.safetensors  a token batch ("tokens", "targets" [B, T] int32) and, in
                                 fp32 and fp64 ("loss32", "loss64" [1]; "grad32.<name>",
                                 "grad64.<name>" per parameter), the mean cross-entropy of
                                 the logits against the targets and every parameter's gradient

fp64: the same model in double. Hugging Face computes some things in float32 whatever the
model's dtype: the rotary angles and RMSNorm's normalisation (for the fp64 reference these
two modules run in float64, patched by hf_fixture.in_float64, which checks its float64
rotary frequencies against Hugging Face's own to float32 precision first) and the "eager"
attention's softmax (so attention is PyTorch's scaled_dot_product_attention, "sdpa", in the
model's dtype).

Config (tests/test_llama.cpp's `tiny`): 2 layers, d_model 32, 4 heads, 2 key/value heads,
ffn 48, vocab 61, rope_theta 10000 with the "llama3" scaling (factor 8, low 1, high 4,
original 64: one frequency of each kind), RMSNorm eps 1e-5, untied, no biases; B 4, T 16.
Regenerate with:  pip install torch transformers safetensors && python3 tests/data/make_hf_llama_fixture.py
(the files here: transformers 5.24.0, torch 2.15.0 on CPU; another torch may draw other random weights,
and the tests read whatever the files hold).
"""
import math
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_fixture import in_float64, norms_away_from_one, reference, token_batch, write_model, write_reference

L, C, H, KV, F, V, T, B = 2, 32, 4, 2, 48, 61, 16, 4
THETA, FACTOR, LOW, HIGH, ORIGINAL = 10000.0, 8.0, 1.0, 4.0, 64
here = os.path.dirname(os.path.abspath(__file__))

config = LlamaConfig(vocab_size=V, hidden_size=C, intermediate_size=F, num_hidden_layers=L, num_attention_heads=H,
                     num_key_value_heads=KV, max_position_embeddings=2 * ORIGINAL, rms_norm_eps=1e-5, rope_theta=THETA,
                     rope_scaling={"rope_type": "llama3", "factor": FACTOR, "low_freq_factor": LOW,
                                   "high_freq_factor": HIGH, "original_max_position_embeddings": ORIGINAL},
                     tie_word_embeddings=False, attention_bias=False, mlp_bias=False, initializer_range=0.2,
                     attn_implementation="sdpa")
torch.manual_seed(0)
model = LlamaForCausalLM(config).eval()
norms_away_from_one(model)
tokens, targets = token_batch(V, B, T)


def inv_freq64():
    hd = C // H
    out = []
    for i in range(hd // 2):
        base = 1.0 / THETA ** (2.0 * i / hd)
        wavelen = 2 * math.pi / base
        if wavelen < ORIGINAL / HIGH:
            out.append(base)
        elif wavelen > ORIGINAL / LOW:
            out.append(base / FACTOR)
        else:
            smooth = (ORIGINAL / wavelen - LOW) / (HIGH - LOW)
            out.append((1 - smooth) * base / FACTOR + smooth * base)
    return torch.tensor(out, dtype=torch.float64)


ref = {"tokens": tokens.to(torch.int32), "targets": targets.to(torch.int32)}
loss32, grads32 = reference(model, tokens, targets)
ref["loss32"] = loss32.reshape(1)
ref.update({"grad32." + n: g for n, g in grads32.items()})
write_model(model, os.path.join(here, "hf_tiny_llama.safetensors"))

loss64, grads64 = reference(in_float64(model, inv_freq64(), "LlamaRMSNorm"), tokens, targets)
ref["loss64"] = loss64.reshape(1)
ref.update({"grad64." + n: g for n, g in grads64.items()})
print("loss fp32", loss32.item(), "fp64", loss64.item(), "difference", abs(loss32.item() - loss64.item()))

write_reference(ref, os.path.join(here, "hf_tiny_llama_ref.safetensors"))
for f in ("hf_tiny_llama.safetensors", "hf_tiny_llama_ref.safetensors"):
    print(f, os.path.getsize(os.path.join(here, f)), "bytes")
