#!/usr/bin/env python3
"""One GPT-2 124M training step in PyTorch, for comparison with bench/train_step.

Same shape as fived's bench: B=8, T=1024, vocab 50257 padded to 50304, 12 layers,
d_model 768, 12 heads, tied embeddings, bf16 autocast (fp32 master weights),
fused AdamW, scaled_dot_product_attention (flash) for causal attention.
Prints the median step time over --steps timed steps (after --warmup), tokens/s
and MFU against the dense bf16 peak of an H100 SXM (989.4 TFLOP/s; pass --peak
for another GPU). FLOPs per token: 6 * params + 12 * L * T * d_model (attention
score and value products, forward + backward, causal mask not discounted),
as in nanoGPT / llm.c.

Usage: python bench/train_step_pytorch.py [--batch 8] [--seq 1024] [--steps 20] [--compile]
"""

import argparse
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

H100_BF16_DENSE_TFLOPS = 989.4  # H100 SXM5, dense (no sparsity)


class Block(nn.Module):
    def __init__(self, d, nh):
        super().__init__()
        self.nh = nh
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.nh, C // self.nh).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab=50304, seq=1024, layers=12, d=768, nh=12):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, nh) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight",)) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--ids", choices=["uniform", "text"], default="uniform",
                    help="token ids drawn uniformly, or as in text (Zipf, as bench/train_step --ids text)")
    ap.add_argument("--peak", type=float, default=H100_BF16_DENSE_TFLOPS, help="bf16 dense peak TFLOP/s for MFU")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("train_step_pytorch.py: no CUDA device")

    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    dev = "cuda"
    V, Vreal, L, d = 50304, 50257, 12, 768
    model = GPT(V, args.seq, L, d, 12).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    step_model = torch.compile(model) if args.compile else model
    if args.ids == "text":  # P(id k) ~ 1/(k + 1), by the inverse of its continuous CDF
        def draw():
            u = torch.rand(args.batch, args.seq, dtype=torch.float64, device=dev)
            return ((Vreal + 1.0) ** u).long().sub(1).clamp(max=Vreal - 1)
        idx, tgt = draw(), draw()
    else:
        idx = torch.randint(0, Vreal, (args.batch, args.seq), device=dev)
        tgt = torch.randint(0, Vreal, (args.batch, args.seq), device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            loss = step_model(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    tokens = args.batch * args.seq
    flops_per_token = 6 * n_params + 12 * L * args.seq * d
    tflops = flops_per_token * tokens / dt / 1e12
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  compile={args.compile}"
          + ("  text-like ids (Zipf)" if args.ids == "text" else ""))
    print(f"GPT-2 124M ({n_params/1e6:.1f}M params), B={args.batch} T={args.seq}, bf16 autocast, fused AdamW")
    print(f"median step {dt*1e3:.1f} ms over {args.steps} steps, loss {loss.item():.3f}")
    print(f"tokens/s {tokens/dt:,.0f}   {tflops:.1f} TFLOP/s   MFU {100*tflops/args.peak:.1f}% "
          f"(of {args.peak} TFLOP/s bf16 dense peak)")


if __name__ == "__main__":
    main()
