"""Train a Llama on a toy grammar, as Hugging Face users write it: no framework beyond transformers.

    python -m hf_causal_lm.train                             # a plain loop: no autotune needed
    python -m hf_causal_lm.train --size gpu                  # the 32 M-parameter Llama, for a GPU
    python -m hf_causal_lm.train --config best.yaml          # the same loop with a config autotune recommended
    python -m hf_causal_lm.train --trainer [--config best.yaml]   # the HF Trainer instead of the loop

The model is built from a LlamaConfig (nothing is downloaded; sdpa attention, HF's default), in
one of two sizes: ``tiny`` (the default: seconds on a laptop CPU) and ``gpu`` (hidden 512, 10
layers, 32 M parameters). The text is generated here and tokenized by characters; random
windows of it are sampled on the device (get_batch); AdamW with no weight decay on biases and
norms, gradient clipping at 1.0, HF's linear warm-up and decay (get_linear_schedule_with_warmup),
bf16 autocast on a GPU (what the Trainer's ``bf16=True`` does). The lines marked ``# autotune``
are all that runs a recommended config (docs/huggingface.md); workload.py tunes this job by
importing its functions.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, get_linear_schedule_with_warmup


# -- config: two sizes of the job (--size) -----------------------------------------------------
@dataclass(frozen=True)
class Size:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    block_size: int  # tokens per sequence
    learning_rate: float
    max_steps: int
    warmup_steps: int
    eval_every: int
    batch_size: int = 16
    accum_steps: int = 1


SIZES = {
    "tiny": Size(64, 176, 2, 4, block_size=64, learning_rate=3e-3, max_steps=200, warmup_steps=20, eval_every=50),
    "gpu": Size(512, 1408, 10, 8, block_size=256, learning_rate=1e-3, max_steps=2000, warmup_steps=100,
                eval_every=500),
}
weight_decay, max_grad_norm = 0.1, 1.0
device = "cuda" if torch.cuda.is_available() else "cpu"
bf16 = device == "cuda"  # mixed precision on a GPU, as the Trainer's bf16=True: autocast to bfloat16


# -- data: sentences of a toy grammar, as character ids ------------------------------------------
def make_corpus(n_sentences: int = 6000, seed: int = 1337) -> str:
    rng = random.Random(seed)
    subjects = ["the cat", "the dog", "a bird", "my friend", "the old man", "a small child"]
    verbs = ["sees", "likes", "follows", "finds", "watches", "hears"]
    objects = ["the ball", "a red kite", "the river", "an apple", "the green door", "a quiet song"]
    lines = [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}." for _ in range(n_sentences)]
    return "\n".join(lines) + "\n"


text = make_corpus()
vocab = sorted(set(text))


def tokens() -> torch.Tensor:
    """The whole text as token ids (the last 10 % validate)."""
    stoi = {ch: i for i, ch in enumerate(vocab)}
    return torch.tensor([stoi[c] for c in text], dtype=torch.long)


def splits() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val): the first 90 % of the token ids and the rest."""
    ids = tokens()
    return ids[:len(ids) * 9 // 10], ids[len(ids) * 9 // 10:]


class Blocks(Dataset):
    """Disjoint blocks of block_size ids, labels = input_ids (the model shifts them), for the Trainer."""

    def __init__(self, ids: torch.Tensor, block_size: int) -> None:
        self.ids, self.block_size = ids, block_size

    def __len__(self) -> int:
        return len(self.ids) // self.block_size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        block = self.ids[i * self.block_size:(i + 1) * self.block_size]
        return {"input_ids": block, "labels": block}


def get_batch(ids: torch.Tensor, n: int, block_size: int, generator: torch.Generator | None = None,
              device: str = device) -> dict[str, torch.Tensor]:
    """`n` random windows of block_size ids of the split, on the device."""
    starts = torch.randint(len(ids) - block_size, (n,), generator=generator)
    x = torch.stack([ids[s:s + block_size] for s in starts]).to(device)
    return {"input_ids": x, "labels": x}


# -- model and optimizer -----------------------------------------------------------------------------
def build_model(size: Size = SIZES["tiny"]) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=size.hidden_size,
                         intermediate_size=size.intermediate_size, num_hidden_layers=size.num_hidden_layers,
                         num_attention_heads=size.num_attention_heads, num_key_value_heads=size.num_attention_heads,
                         max_position_embeddings=size.block_size, use_cache=False)  # training: no KV cache
    return LlamaForCausalLM(config)


def configure_optimizer(model: nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW, two groups: no weight decay on biases and norm weights (the 1-D parameters)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}], lr=lr)


def lr_lambda(step: float, total: int, warmup_steps: int) -> float:
    """get_linear_schedule_with_warmup's factor: linear warm-up, then linear decay to 0 at `total`."""
    warmup = min(warmup_steps, total // 10)
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


@torch.no_grad()
def val_loss(model: nn.Module, val: torch.Tensor, block_size: int) -> float:
    model.eval()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
        loss = float(model(**get_batch(val, 32, block_size, torch.Generator().manual_seed(1234))).loss)
    model.train()
    return loss


# -- training ----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description="Train a Llama on a toy grammar.")
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--max-steps", type=int, default=None, help="default: the size's")
    parser.add_argument("--config", default=None, help="a config autotune recommended (best.yaml)")
    parser.add_argument("--trainer", action="store_true", help="train with the HF Trainer")
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    max_steps = args.max_steps or size.max_steps
    train, val = splits()
    torch.manual_seed(1337)
    model = build_model(size)
    if args.trainer:
        return train_with_trainer(model, train, val, size, max_steps, args.config)
    model.to(device)
    optimizer = configure_optimizer(model, size.learning_rate)
    micro_batch, accum = size.batch_size, size.accum_steps
    if args.config:  # autotune
        import autotune  # autotune
        from autotune.workloads.hf import causal_lm_loss  # autotune
        prepared = autotune.apply(args.config, model, optimizer=optimizer, device=device,  # autotune
                                  grad_clip_norm=max_grad_norm, loss_fn=causal_lm_loss)  # autotune
        micro_batch, accum = prepared.config.batch_size, prepared.accum_steps  # autotune
        max_steps = max_steps * size.batch_size * size.accum_steps // (micro_batch * accum)  # autotune
    scheduler = get_linear_schedule_with_warmup(optimizer, min(size.warmup_steps, max_steps // 10), max_steps)
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters, {max_steps} steps of "
          f"{micro_batch} x {accum} blocks of {size.block_size}")
    loss = val_loss(model, val, size.block_size)
    for step in range(1, max_steps + 1):
        if args.config:  # autotune
            for _ in range(accum):  # autotune
                prepared.step(get_batch(train, micro_batch, size.block_size))  # autotune
        else:
            for _ in range(accum):
                with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
                    micro_loss = model(**get_batch(train, micro_batch, size.block_size)).loss
                (micro_loss / accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if step % size.eval_every == 0 or step == max_steps:
            loss = val_loss(model, val, size.block_size)
            print(f"step {step}: val loss {loss:.4f}, lr {scheduler.get_last_lr()[0]:.2e}")
    if args.config:  # autotune
        print(prepared.loop_rate() or "autotune: too few steps to time this loop")  # autotune
    return loss


def train_with_trainer(model: nn.Module, train: torch.Tensor, val: torch.Tensor, size: Size, max_steps: int,
                       config: str | None) -> float:
    from transformers import Trainer, TrainingArguments

    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out, max_steps=max_steps, per_device_train_batch_size=size.batch_size,
            gradient_accumulation_steps=size.accum_steps, learning_rate=size.learning_rate,
            weight_decay=weight_decay, lr_scheduler_type="linear", warmup_steps=min(size.warmup_steps, max_steps // 10),
            max_grad_norm=max_grad_norm, bf16=bf16, use_cpu=device == "cpu", report_to=[], save_strategy="no",
            logging_steps=size.eval_every, disable_tqdm=True)
        if config:  # autotune
            from autotune.workloads.hf import training_arguments  # autotune
            targs = training_arguments(config, targs, model)  # autotune
        trainer = Trainer(model=model, args=targs, train_dataset=Blocks(train, size.block_size),
                          eval_dataset=Blocks(val, size.block_size))
        trainer.train()
        loss = float(trainer.evaluate()["eval_loss"])
    print(f"step {max_steps}: val loss {loss:.4f}")
    return loss


if __name__ == "__main__":
    main()
