# The glue: train.py's job as the autotune workload `hf-causal-lm` (registered in pyproject.toml).
# Its model factory, its tokens, its block size and its hyper-parameters; the helper supplies the
# rest (blocks with labels = input_ids, AdamW without decay on biases and norms, val_loss in fp32).
from autotune.workloads import TrainingDefaults
from autotune.workloads.hf import causal_lm_workload
from hf_causal_lm import train

TinyLlama = causal_lm_workload(
    "hf-causal-lm", train.build_model, train.tokens, block_size=train.block_size,
    defaults=TrainingDefaults(batch_size=train.batch_size, accum_steps=train.accum_steps, lr=train.learning_rate,
                              samples=2048, weight_decay=train.weight_decay, grad_clip_norm=train.max_grad_norm),
    lr_multiplier=lambda progress: train.lr_lambda(progress * train.max_steps),  # its schedule, over the probe
)
