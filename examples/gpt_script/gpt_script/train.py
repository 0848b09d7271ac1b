"""Train a tiny character-level GPT, nanoGPT style: one file, no framework.

    python train.py                       # the script as written: no autotune needed
    python train.py --config best.yaml    # the same run with a config autotune recommended
    python train.py --size char           # nanoGPT's shakespeare-char shape (10.7 M parameters), for a GPU

The data is generated here (a toy grammar, fixed seed: nothing to download); the model is
a small causal transformer; AdamW with two parameter groups (weight decay on the matrices
only), gradient clipping at 1.0, linear warm-up then cosine decay, the loss logged every
few iterations. The lines marked ``# autotune`` are all that runs a recommended config
(docs/tutorial.md, part 2); workload.py tunes this job by importing its functions.
"""

from __future__ import annotations

import argparse
import math
import random

import torch
import torch.nn as nn
from torch.nn import functional as F

# -- config ----------------------------------------------------------------------------------
batch_size = 16
gradient_accumulation_steps = 1
block_size = 32
n_layer, n_head, n_embd = 2, 4, 64
learning_rate = 3e-3
max_iters = 300
warmup_iters = 20
min_lr = learning_rate / 10
# --size: the default above, or nanoGPT's shakespeare-char shape (6 layers of 384, 256 characters
# a sequence, 64 sequences a step), whose step keeps a GPU busy where the tiny one waits on Python
SIZES = {
    "tiny": {"batch_size": 16, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 64, "learning_rate": 3e-3},
    "char": {"batch_size": 64, "block_size": 256, "n_layer": 6, "n_head": 6, "n_embd": 384, "learning_rate": 1e-3},
}
weight_decay = 0.1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0
eval_interval, eval_iters, log_interval = 100, 10, 20
device = "cuda" if torch.cuda.is_available() else "cpu"


def use_size(name: str) -> None:
    """Set the config above to one of SIZES (the model, data and loop read it when they run)."""
    global min_lr
    if name not in SIZES:
        raise ValueError(f"unknown size (preset) {name!r} for gpt_script; known: {', '.join(SIZES)}")
    globals().update(SIZES[name])
    min_lr = learning_rate / 10


# -- data: sentences of a toy grammar, as characters -------------------------------------------
def make_corpus(n_sentences: int = 6000, seed: int = 1337) -> str:
    rng = random.Random(seed)
    subjects = ["the cat", "the dog", "a bird", "my friend", "the old man", "a small child"]
    verbs = ["sees", "likes", "follows", "finds", "watches", "hears"]
    objects = ["the ball", "a red kite", "the river", "an apple", "the green door", "a quiet song"]
    places = ["in the park", "at home", "by the sea", "after dark", "every day"]
    lines = []
    for _ in range(n_sentences):
        line = f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}"
        if rng.random() < 0.5:
            line += f" {rng.choice(places)}"
        lines.append(line + ".")
    return "\n".join(lines) + "\n"


text = make_corpus()
chars = sorted(set(text))
vocab_size = len(chars)
stoi = {ch: i for i, ch in enumerate(chars)}
data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
n = int(0.9 * len(data))
train_data, val_data = data[:n], data[n:]


def get_batch(split: str, n: int | None = None, device: str = device,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` (default: batch_size) random windows of the split: inputs x and next-character targets y."""
    d = train_data if split == "train" else val_data
    n = n or batch_size
    ix = torch.randint(len(d) - block_size, (n,), generator=generator)
    x = torch.stack([d[i : i + block_size] for i in ix])
    y = torch.stack([d[i + 1 : i + 1 + block_size] for i in ix])
    return x.to(device), y.to(device)


# -- model -------------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor,
                targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))


def build_model() -> GPT:
    return GPT()


def configure_optimizers(model: nn.Module, weight_decay: float, lr: float,
                         betas: tuple[float, float]) -> torch.optim.AdamW:
    """AdamW, two groups: weight decay on every 2-D tensor (matmuls, embeddings), none on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


def get_lr(it: float, max_iters: int = max_iters) -> float:
    """Linear warm-up for warmup_iters (a tenth of a shorter run), then cosine decay to min_lr at max_iters."""
    warmup = min(warmup_iters, max_iters // 10)
    if it < warmup:
        return learning_rate * (it + 1) / (warmup + 1)
    if it > max_iters:
        return min_lr
    coeff = 0.5 * (1.0 + math.cos(math.pi * (it - warmup) / (max_iters - warmup)))
    return min_lr + coeff * (learning_rate - min_lr)


@torch.no_grad()
def estimate_loss(model: nn.Module, split: str, device: str = device) -> float:
    """Mean loss over eval_iters fixed batches of the split (the same batches every time)."""
    g = torch.Generator().manual_seed(1234)
    was_training = model.training
    model.eval()
    losses = [model(*get_batch(split, device=device, generator=g))[1].item() for _ in range(eval_iters)]
    model.train(was_training)
    return sum(losses) / len(losses)


# -- training ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description="Train a tiny character-level GPT.")
    parser.add_argument("--max-iters", type=int, default=max_iters)
    parser.add_argument("--config", default=None, help="a config autotune recommended (best.yaml)")
    parser.add_argument("--size", choices=SIZES, default="tiny", help="the model and batch (SIZES)")
    args = parser.parse_args(argv)
    use_size(args.size)

    torch.manual_seed(1337)
    model = build_model().to(device)
    optimizer = configure_optimizers(model, weight_decay, learning_rate, (beta1, beta2))
    micro_batch, accum = batch_size, gradient_accumulation_steps
    if args.config:  # autotune
        import autotune  # autotune
        prepared = autotune.apply(args.config, model, optimizer=optimizer, device=device,  # autotune
                                  grad_clip_norm=grad_clip, loss_fn=lambda m, b, aux: m(*b)[1])  # autotune
        micro_batch, accum = prepared.config.batch_size, prepared.accum_steps  # autotune
        args.max_iters = args.max_iters * batch_size * gradient_accumulation_steps // (micro_batch * accum)  # autotune
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters, vocab {vocab_size}, "
          f"{args.max_iters} iterations of {micro_batch} x {accum} sequences of {block_size}")

    for it in range(args.max_iters + 1):
        lr = get_lr(it, args.max_iters)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if it % eval_interval == 0 or it == args.max_iters:
            val_loss = estimate_loss(model, "val")
            print(f"step {it}: val loss {val_loss:.4f}")
        if it == args.max_iters:
            break
        if args.config:  # autotune
            for _ in range(accum):  # autotune
                loss = prepared.step(get_batch("train", micro_batch))  # autotune
        else:
            for _ in range(accum):
                x, y = get_batch("train", micro_batch)
                _, loss = model(x, y)
                (loss / accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if it % log_interval == 0:
            print(f"iter {it}: loss {loss.item():.4f}, lr {lr:.2e}")
    if args.config:  # autotune
        print(prepared.loop_rate() or "autotune: too few iterations to time this loop")  # autotune
    return val_loss


if __name__ == "__main__":
    main()
