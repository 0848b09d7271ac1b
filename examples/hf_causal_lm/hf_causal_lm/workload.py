# The glue: train.py's job as the autotune workload `hf-causal-lm` (registered in pyproject.toml), a preset
# per size of the script (--size tiny|gpu). Its model, its tokens, its own data path (get_batch), its
# hyper-parameters and schedule; the helper supplies the rest (AdamW without decay on biases and norms,
# val_loss in fp32 over the last 10 % of the tokens, the checkpoint knob on the model's own switch).
import torch

from autotune.workloads import TrainingDefaults
from autotune.workloads.hf import HFCausalLM
from hf_causal_lm import train


class Llama(HFCausalLM):
    name = "hf-causal-lm"
    presets = {size: TrainingDefaults(batch_size=s.batch_size, accum_steps=s.accum_steps, lr=s.learning_rate,
                                      samples=s.batch_size * s.max_steps // 2, weight_decay=train.weight_decay,
                                      grad_clip_norm=train.max_grad_norm) for size, s in train.SIZES.items()}

    def __init__(self, preset: str) -> None:
        super().__init__(preset)
        self.size = train.SIZES[preset]
        self.block_size = self.size.block_size
        self.train_ids: torch.Tensor | None = None  # read when a probe starts

    def hf_model(self) -> torch.nn.Module:
        return train.build_model(self.size)

    def tokens(self) -> torch.Tensor:
        return train.tokens()

    def sample_batch(self, batch_size: int, generator: torch.Generator, device: torch.device) -> dict:
        if self.train_ids is None:
            self.train_ids = train.splits()[0]
        return train.get_batch(self.train_ids, batch_size, self.block_size, generator, str(device))

    def lr_multiplier(self, progress: float) -> float:  # get_linear_schedule_with_warmup over the probe
        return train.lr_lambda(progress * self.size.max_steps, self.size.max_steps, self.size.warmup_steps)
