"""An example training job: a small MLP regressing a noisy 1-D signal (docs/tutorial.md).

`model.py` and `data.py` are "your" code as it was before autotune; `workload.py` wraps
them for autotune's probes (about 30 lines); `train.py` is your training loop, which
adopts a recommended config with `autotune.apply`.
"""
