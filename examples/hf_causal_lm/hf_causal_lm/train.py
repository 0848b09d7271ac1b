"""Train a tiny Llama on a toy grammar, as Hugging Face users write it: no framework beyond transformers.

    python -m hf_causal_lm.train                             # a plain loop: no autotune needed
    python -m hf_causal_lm.train --config best.yaml          # the same loop with a config autotune recommended
    python -m hf_causal_lm.train --trainer [--config best.yaml]   # the HF Trainer instead of the loop

The model is built from a LlamaConfig (nothing is downloaded); the text is generated here and
tokenized by characters; AdamW with no weight decay on biases and norms, gradient clipping at
1.0, HF's linear warm-up and decay (get_linear_schedule_with_warmup). The lines marked
``# autotune`` are all that runs a recommended config (docs/huggingface.md); workload.py tunes
this job by importing its functions.
"""

from __future__ import annotations

import argparse
import random
import tempfile

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, get_linear_schedule_with_warmup

# -- config ----------------------------------------------------------------------------------
block_size = 64
batch_size, accum_steps = 16, 1
learning_rate, weight_decay, max_grad_norm = 3e-3, 0.1, 1.0
max_steps, warmup_steps = 200, 20
eval_every = 50
device = "cuda" if torch.cuda.is_available() else "cpu"


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


class Blocks(Dataset):
    """Disjoint blocks of block_size ids, labels = input_ids (the model shifts them), for the Trainer."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids) // block_size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        block = self.ids[i * block_size:(i + 1) * block_size]
        return {"input_ids": block, "labels": block}


def get_batch(ids: torch.Tensor, n: int, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """`n` random windows of the split, on the device."""
    starts = torch.randint(len(ids) - block_size, (n,), generator=generator)
    x = torch.stack([ids[s:s + block_size] for s in starts]).to(device)
    return {"input_ids": x, "labels": x}


# -- model and optimizer -----------------------------------------------------------------------------
def build_model() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=block_size)
    return LlamaForCausalLM(config)


def configure_optimizer(model: nn.Module, lr: float = learning_rate) -> torch.optim.AdamW:
    """AdamW, two groups: no weight decay on biases and norm weights (the 1-D parameters)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}], lr=lr)


def lr_lambda(step: float, total: int = max_steps) -> float:
    """get_linear_schedule_with_warmup's factor: linear warm-up, then linear decay to 0 at `total`."""
    warmup = min(warmup_steps, total // 10)
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


@torch.no_grad()
def val_loss(model: nn.Module, val: torch.Tensor) -> float:
    model.eval()
    batch = get_batch(val, 32, torch.Generator().manual_seed(1234))
    loss = float(model(**batch).loss)
    model.train()
    return loss


# -- training ----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description="Train a tiny Llama on a toy grammar.")
    parser.add_argument("--max-steps", type=int, default=max_steps)
    parser.add_argument("--config", default=None, help="a config autotune recommended (best.yaml)")
    parser.add_argument("--trainer", action="store_true", help="train with the HF Trainer")
    args = parser.parse_args(argv)
    ids = tokens()
    train, val = ids[:len(ids) * 9 // 10], ids[len(ids) * 9 // 10:]
    torch.manual_seed(1337)
    model = build_model()
    if args.trainer:
        return train_with_trainer(model, train, val, args)
    model.to(device)
    optimizer = configure_optimizer(model)
    micro_batch, accum = batch_size, accum_steps
    if args.config:  # autotune
        import autotune  # autotune
        from autotune.workloads.hf import causal_lm_loss  # autotune
        prepared = autotune.apply(args.config, model, optimizer=optimizer, device=device,  # autotune
                                  grad_clip_norm=max_grad_norm, loss_fn=causal_lm_loss)  # autotune
        micro_batch, accum = prepared.config.batch_size, prepared.accum_steps  # autotune
        args.max_steps = args.max_steps * batch_size * accum_steps // (micro_batch * accum)  # autotune
    scheduler = get_linear_schedule_with_warmup(optimizer, min(warmup_steps, args.max_steps // 10), args.max_steps)
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters, {args.max_steps} steps of "
          f"{micro_batch} x {accum} blocks of {block_size}")
    loss = val_loss(model, val)
    for step in range(1, args.max_steps + 1):
        if args.config:  # autotune
            for _ in range(accum):  # autotune
                prepared.step(get_batch(train, micro_batch))  # autotune
        else:
            for _ in range(accum):
                (model(**get_batch(train, micro_batch)).loss / accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if step % eval_every == 0 or step == args.max_steps:
            loss = val_loss(model, val)
            print(f"step {step}: val loss {loss:.4f}, lr {scheduler.get_last_lr()[0]:.2e}")
    return loss


def train_with_trainer(model: nn.Module, train: torch.Tensor, val: torch.Tensor, args: argparse.Namespace) -> float:
    from transformers import Trainer, TrainingArguments

    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out, max_steps=args.max_steps, per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accum_steps, learning_rate=learning_rate, weight_decay=weight_decay,
            lr_scheduler_type="linear", warmup_steps=min(warmup_steps, args.max_steps // 10),
            max_grad_norm=max_grad_norm, use_cpu=device == "cpu", report_to=[], save_strategy="no",
            logging_steps=eval_every, disable_tqdm=True)
        if args.config:  # autotune
            from autotune.workloads.hf import training_arguments  # autotune
            targs = training_arguments(args.config, targs, model)  # autotune
        trainer = Trainer(model=model, args=targs, train_dataset=Blocks(train), eval_dataset=Blocks(val))
        trainer.train()
        loss = float(trainer.evaluate()["eval_loss"])
    print(f"step {args.max_steps}: val loss {loss:.4f}")
    return loss


if __name__ == "__main__":
    main()
