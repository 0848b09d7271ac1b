"""Your training loop, adopting a recommended config with autotune.apply.

    python -m my_workload.train --config best.yaml --epochs 2

Without autotune this loop would build the same model, optimizer and loader and call
``loss.backward(); optimizer.step()``; the three marked lines are all it takes to run the
config a study recommended (precision, compile, checkpointing, fused optimizer, loader
workers, batch size, accumulation, auxiliary-loss frequency).
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader

import autotune
from my_workload.data import make_datasets
from my_workload.model import Regressor


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="a recommended config (autotune best --format yaml)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    train, val = make_datasets()
    model = Regressor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(train, batch_size=8, shuffle=True)

    config = autotune.load_config(args.config) if args.config else {}                       # autotune
    prepared = autotune.apply(config, model, optimizer=optimizer, train_loader=loader,       # autotune
                              device=args.device, loss_fn=lambda m, batch, aux: m(batch, aux)["total"])

    for epoch in range(args.epochs):
        for batch in prepared.train_loader or loader:
            prepared.step(batch)                                                             # autotune
        with torch.no_grad():
            pred = prepared.module.predict(val.x.to(prepared.device))
            val_loss = float(torch.nn.functional.mse_loss(pred.float(), val.y.to(prepared.device)))
        print(f"epoch {epoch + 1}: val_loss {val_loss:.4f} ({prepared.optimizer_steps} optimizer steps)")
    print("config:", {k: v for k, v in prepared.config.to_dict().items() if v is not None})
    return val_loss


if __name__ == "__main__":
    main()
