"""The ``step_graph`` knob: the whole optimizer step replayed as one CUDA graph.

At a small batch a compiled transformer's step is bound by the host, not the GPU: the
training loop's thread spends its time on per-parameter work around the kernels (autograd's
gradient accumulation, one call per parameter; the optimizer's Python loop over its
parameters; the launches), while the GPU idles between kernels (bench/README.md, "where the
host's time goes in a step"). Such a config runs at the speed of one host thread, and that
speed drifts on a shared host, so its throughput does too. ``compile=reduce-overhead``
captures the forward and the backward as CUDA graphs but leaves the optimizer and autograd's
bookkeeping on the host.

With ``step_graph: true`` the probe (and `autotune.apply`) captures everything one optimizer
step does on the GPU, the forward and backward of every micro-batch, the gradient clipping,
the update of every optimizer (AdamW, or the workload's own, e.g. Muon + AdamW) and the
zeroing of the gradients, as one CUDA graph per step variant (with and without the inverse
losses). A step is then: copy the new micro-batches into the graph's input buffers, set the
learning rate in its device tensor, launch the graph. What stays on the host per step is a
handful of calls, whatever the number of parameters.

How, in the order it happens:

* Each optimizer reads its state and learning rate on the device: an optimizer with a
  capturable mode (Adam, AdamW) is switched to it (step counters on the device), and each
  group's learning rate becomes a device tensor the schedule writes into
  (`autotune.engine.optimizers.lr_to_tensor`; ``Trainer`` does this before any step). An optimizer
  without a capturable mode (torch's Muon, SGD) is captured through its compiled step
  (``compile_optimizer``), which reads the lr tensor on the device; eager, it would read the
  lr on the host once, at capture.
  Gradients are allocated once and zeroed in place, never set to None, so the graph's
  backward accumulates into the same tensors every replay.
* Each variant first runs ``EAGER_RUNS`` ordinary steps on a side stream: torch.compile
  compiles, the optimizer's state is created, the allocator settles (what CUDA graph capture
  requires). These are real training steps.
* The next step of that variant is captured (capturing runs nothing), then replayed. From
  then on the variant is replayed; its loss is copied out of the graph's output each step.

Where it cannot act it is recorded inactive, with the reason (`blocker`): not on a CUDA
device; with several ranks (the gradient all-reduce is not captured); with
``compile=reduce-overhead`` or ``max-autotune``, which capture CUDA graphs of their own; with
fp16, whose GradScaler reads the gradients' inf check on the host every step; with an
optimizer that has neither a capturable mode nor a compiled step (the reason names
``compile_optimizer``). A step that cannot be captured all the same (an
operation that synchronises with the host, a data-dependent shape) fails the probe as
``unsupported``, naming the knob, rather than training on unmeasured.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree

from autotune.contract.config import TrainConfig
from autotune.contract.errors import ProbeError

EAGER_RUNS = 2  # eager steps of each variant before it is captured (the first compiles, the second settles)

CUDA_GRAPH_COMPILE_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that capture graphs themselves


def setting_blocker(config: TrainConfig, device: torch.device, world: int) -> str | None:
    """Why ``step_graph`` cannot act with these knobs on this device and world (None: it can)."""
    if device.type != "cuda":
        return f"inactive on {device.type}: CUDA graphs need a CUDA device"
    if world > 1:
        return "inactive with several ranks: the gradient all-reduce is not captured"
    if config.compile in CUDA_GRAPH_COMPILE_MODES:
        return f"inactive: compile={config.compile} captures CUDA graphs of its own"
    if config.precision == "fp16":
        return "inactive: fp16's GradScaler checks the gradients for inf on the host every step"
    return None


def blocker(config: TrainConfig, device: torch.device, world: int, optimizers: Iterable[torch.optim.Optimizer],
            compiled_step: bool = False) -> str | None:
    """Why ``step_graph`` cannot act for this run (None: it can): `setting_blocker`, then each
    optimizer. An optimizer is captured in its capturable mode (Adam, AdamW: step counters and
    lr on the device), or through its compiled step (`compiled_step`: ``compile_optimizer``
    reads the lr as a device tensor); an eager optimizer without a capturable mode (torch's
    Muon, SGD) reads its lr on the host, which a graph would freeze at capture."""
    why = setting_blocker(config, device, world)
    if why is not None:
        return why
    for optimizer in optimizers:
        name = type(optimizer).__name__
        if optimizer.state:
            return f"inactive: {name} has state already (make it capturable before its first step)"
        if not compiled_step and any("capturable" not in group for group in optimizer.param_groups):
            return (f"inactive: {name} has no capturable mode (AdamW and Adam have): set compile_optimizer: "
                    f"true, whose compiled step reads the learning rate on the device and can be captured")
    return None


def _static_like(batch: Any) -> Any:
    """Empty device buffers shaped like `batch` (a tensor, or a dict/tuple/list of them)."""
    return pytree.tree_map_only(torch.Tensor, torch.empty_like, batch)


def _copy_into(static: Any, batch: Any, where: str = "batch") -> None:
    """Copy `batch` into the buffers `static`; a changed shape or structure is an error
    (a graph replays with the shapes it was captured with)."""
    buffers, spec = pytree.tree_flatten_with_path(static)
    values, got_spec = pytree.tree_flatten(batch)
    if got_spec != spec:
        raise ValueError(f"step_graph: {where}'s structure changed from {spec} to {got_spec}")
    for (path, buffer), value in zip(buffers, values, strict=True):
        if not isinstance(buffer, torch.Tensor):
            continue
        if not isinstance(value, torch.Tensor) or value.shape != buffer.shape or value.dtype != buffer.dtype:
            got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"step_graph: {where}{pytree.keystr(path)} changed from {tuple(buffer.shape)} "
                             f"{buffer.dtype} to {got}; a CUDA graph replays fixed shapes (keep every micro-batch "
                             "full, e.g. drop_last=True), or set step_graph: false")
        buffer.copy_(value, non_blocking=True)


class StepGraph:
    """Runs a trainer's device work (`step_device`: forward/backward over micro-batches, then
    the optimizer update) eagerly on a side stream for `EAGER_RUNS` steps of each variant,
    then as one captured CUDA graph per variant (the module docstring says how)."""

    def __init__(self, step_device: Callable[[list[Any], bool], torch.Tensor], device: torch.device) -> None:
        self.step_device = step_device
        self.device = device
        self.side = torch.cuda.Stream(device)
        self.eager: dict[bool, int] = {}  # variant (with inverse losses) → eager steps run
        self.graphs: dict[bool, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[bool, torch.Tensor] = {}  # each graph's loss output (overwritten by each replay)
        self.static: list[Any] | None = None  # the graphs' input buffers, one per micro-batch
        self.replays = 0

    def run(self, micro_batches: list[Any], with_inverse: bool) -> torch.Tensor:
        """One optimizer step's device work; returns its loss (a tensor of its own)."""
        if self.eager.get(with_inverse, 0) < EAGER_RUNS:
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            current = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self.side):
                loss = self.step_device(micro_batches, with_inverse)
            current.wait_stream(self.side)
            loss.record_stream(current)  # allocated on the side stream, read on the current one
            self.eager[with_inverse] = self.eager.get(with_inverse, 0) + 1
            return loss
        if self.static is None:
            self.static = [_static_like(b) for b in micro_batches]
        if len(micro_batches) != len(self.static):
            raise ValueError(f"step_graph: {len(micro_batches)} micro-batches in a step, captured with "
                             f"{len(self.static)}")
        for i, (static, batch) in enumerate(zip(self.static, micro_batches, strict=True)):
            _copy_into(static, batch, f"micro-batch {i}")
        if with_inverse not in self.graphs:
            self._capture(with_inverse)
        self.graphs[with_inverse].replay()
        self.replays += 1
        return self.outputs[with_inverse].clone()

    def _capture(self, with_inverse: bool) -> None:
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: CUDA calls from other threads (the DataLoader's pin-memory thread
            # allocating page-locked buffers) do not invalidate this thread's capture
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.outputs[with_inverse] = self.step_device(self.static or [], with_inverse)
        except Exception as e:
            raise ProbeError("unsupported", f"step_graph: the step could not be captured as a CUDA graph "
                                            f"({type(e).__name__}: {str(e)[:300]}); set step_graph: false") from e
        self.graphs[with_inverse] = graph
