"""What tests/data/make_hf_llama_fixture.py and make_hf_mixtral_fixture.py share: the
reference pass, the float64 model, and writing the files."""
import os
import tempfile

import torch
from safetensors.torch import save_file


def norms_away_from_one(model):
    """Adds noise to every norm's weight, so their gradients matter (in place, seeded by the caller)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))


def token_batch(vocab, batch, seq):
    """The tokens and targets [batch, seq], drawn from a generator of their own (seed 1)."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    targets = torch.randint(0, vocab, (batch, seq), generator=g)
    return tokens, targets


def reference(model, tokens, targets):
    """The mean cross-entropy of the model's logits against the targets, and every parameter's gradient."""
    model.zero_grad()
    logits = model(input_ids=tokens).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _rmsnorm64(self, x):
    variance = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


def in_float64(model, inv_freq64, norm_class, patches=None):
    """The model in double, with what Hugging Face computes in float32 whatever the dtype in
    float64: the rotary angles (from inv_freq64, checked against Hugging Face's own to float32
    precision first) and the RMSNorms (modules named norm_class); `patches` maps other module
    class names to float64 forwards."""
    hf_freq = model.model.rotary_emb.inv_freq.double()
    assert torch.allclose(inv_freq64, hf_freq, rtol=1e-6, atol=0), (inv_freq64, hf_freq)

    def rotary64(x, position_ids):
        freqs = position_ids[..., None].double() * inv_freq64
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    forwards = {norm_class: _rmsnorm64, **(patches or {})}
    model64 = model.double()
    model64.model.rotary_emb.forward = rotary64
    for module in model64.modules():
        if type(module).__name__ in forwards:
            module.forward = forwards[type(module).__name__].__get__(module)
    return model64


def write_model(model, path):
    """The model's safetensors file as save_pretrained writes it."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        os.replace(os.path.join(tmp, "model.safetensors"), path)


def write_reference(ref, path):
    save_file({k: v.contiguous() for k, v in ref.items()}, path, metadata={"format": "pt"})
