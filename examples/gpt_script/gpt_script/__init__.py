"""A training script as people write them, and the glue that tunes it (docs/tutorial.md, part 2).

`train.py` is the script: runnable on its own, without autotune (``python train.py``).
`workload.py` makes its job an autotune workload (``gpt-script``) from the script's own
functions; ``train.py --config best.yaml`` runs a recommended config through autotune.apply.
"""
