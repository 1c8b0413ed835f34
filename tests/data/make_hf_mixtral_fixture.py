"""Writes the Mixtral fixtures tests/test_llama.cpp pins fived's Llama with experts to, from
Hugging Face `transformers` itself:

  hf_tiny_mixtral.safetensors      a random tiny MixtralForCausalLM as save_pretrained writes
                                   it: each expert's w1 (gate), w3 (up) and w2 (down) a tensor
                                   of its own, "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
                                   the router "model.layers.{i}.block_sparse_moe.gate.weight"
  hf_tiny_mixtral_ref.safetensors  a token batch ("tokens", "targets" [B, T] int32) and, in fp32
                                   and fp64 ("loss32", "loss64" [1]; "grad32.<name>",
                                   "grad64.<name>" per tensor of the file above, under its name
                                   there), the mean cross-entropy of the logits against the
                                   targets and every parameter's gradient

Mixtral's loss has no balancing term unless output_router_logits is set (it is not here), so
the fived model has aux_loss_coef 0 and no selection bias. fp64: the same model in double, with
what Hugging Face computes in float32 whatever the model's dtype (the rotary angles, RMSNorm's
normalisation and the router's softmax) patched to run in float64; attention is "sdpa", the
experts "eager" (a loop over them; the grouped GEMM has no float64).

Config (tests/test_llama.cpp's `mixtral_tiny`): 2 layers, d_model 32, 4 heads, 2 key/value
heads, 4 experts of width 48, top-2 in every block, vocab 61, rope_theta 1e6 (Mixtral's, no
scaling), RMSNorm eps 1e-5, untied; B 4, T 16. The script checks that no token's second and
third expert scores are close (a routing decision both sides must make alike).
Regenerate with:  pip install torch transformers safetensors && python3 tests/data/make_hf_mixtral_fixture.py
(the files here: transformers 5.24.0, torch 2.15.0 on CPU; another torch may draw other random weights,
and the tests read whatever the files hold).
"""
import os

import torch
from transformers import MixtralConfig, MixtralForCausalLM

from hf_fixture import in_float64, norms_away_from_one, reference, token_batch, write_model, write_reference

L, C, H, KV, F, V, E, K, T, B = 2, 32, 4, 2, 48, 61, 4, 2, 16, 4
THETA = 1e6
here = os.path.dirname(os.path.abspath(__file__))

config = MixtralConfig(vocab_size=V, hidden_size=C, intermediate_size=F, num_hidden_layers=L, num_attention_heads=H,
                       num_key_value_heads=KV, num_local_experts=E, num_experts_per_tok=K, max_position_embeddings=128,
                       rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": THETA},
                       tie_word_embeddings=False, initializer_range=0.2, output_router_logits=False,
                       router_jitter_noise=0.0, attn_implementation="sdpa", experts_implementation="eager")
torch.manual_seed(0)
model = MixtralForCausalLM(config).eval()
norms_away_from_one(model)
tokens, targets = token_batch(V, B, T)


def file_grads(prefix, grads):
    """The gradients under the file's names: each expert's w1, w3 and w2 apart."""
    out = {}
    for n, gr in grads.items():
        if n.endswith("mlp.experts.gate_up_proj"):
            base = n[: -len("mlp.experts.gate_up_proj")] + "block_sparse_moe.experts."
            for e in range(E):
                out[f"{prefix}.{base}{e}.w1.weight"] = gr[e, :F]
                out[f"{prefix}.{base}{e}.w3.weight"] = gr[e, F:]
        elif n.endswith("mlp.experts.down_proj"):
            base = n[: -len("mlp.experts.down_proj")] + "block_sparse_moe.experts."
            for e in range(E):
                out[f"{prefix}.{base}{e}.w2.weight"] = gr[e]
        elif n.endswith("mlp.gate.weight"):
            out[f"{prefix}.{n[: -len('mlp.gate.weight')]}block_sparse_moe.gate.weight"] = gr
        else:
            out[f"{prefix}.{n}"] = gr
    return out


closest = [1.0]


def watch_router(module, inputs, output):
    probs = torch.softmax(output[0].double(), dim=-1).sort(dim=-1, descending=True).values
    closest[0] = min(closest[0], (probs[:, K - 1] - probs[:, K]).min().item())


hooks = [mod.register_forward_hook(watch_router) for mod in model.modules() if type(mod).__name__ == "MixtralTopKRouter"]
ref = {"tokens": tokens.to(torch.int32), "targets": targets.to(torch.int32)}
loss32, grads32 = reference(model, tokens, targets)
for h in hooks:
    h.remove()
assert closest[0] > 1e-3, f"a token's 2nd and 3rd expert scores differ by only {closest[0]}: pick another seed"
ref["loss32"] = loss32.reshape(1)
ref.update(file_grads("grad32", grads32))

write_model(model, os.path.join(here, "hf_tiny_mixtral.safetensors"))


def inv_freq64():
    hd = C // H
    return 1.0 / THETA ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)


def router64(self, hidden_states):  # MixtralTopKRouter.forward without its float32 softmax
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, self.weight)
    top, index = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    return logits, top / top.sum(dim=-1, keepdim=True), index


model64 = in_float64(model, inv_freq64(), "MixtralRMSNorm", {"MixtralTopKRouter": router64})
loss64, grads64 = reference(model64, tokens, targets)
ref["loss64"] = loss64.reshape(1)
ref.update(file_grads("grad64", grads64))
print("loss fp32", loss32.item(), "fp64", loss64.item(), "difference", abs(loss32.item() - loss64.item()),
      "closest 2nd/3rd expert scores", closest[0])

write_reference(ref, os.path.join(here, "hf_tiny_mixtral_ref.safetensors"))
for f in ("hf_tiny_mixtral.safetensors", "hf_tiny_mixtral_ref.safetensors"):
    print(f, os.path.getsize(os.path.join(here, f)), "bytes")
