"""The ``step_graph`` knob: the whole optimizer step replayed as one CUDA graph.

At a small batch a compiled transformer's step is bound by the host's per-parameter work
(autograd's accumulation, the optimizer's loop, the launches) while the GPU idles, and
``compile=reduce-overhead`` graphs only the forward and backward. With ``step_graph: true`` the
probe (and `autotune.apply`) captures everything a step does on the GPU (forward and backward of
every micro-batch, clipping, every optimizer's update, zeroing the gradients) as one CUDA graph
per step variant (with and without the inverse losses); a step is then: copy the micro-batches
into the graph's inputs, set the lr tensor, launch. Each variant first runs ``EAGER_RUNS``
ordinary steps on a side stream (compilation, optimizer state, allocator), then is captured and
replayed. Optimizers read their state and lr on the device (a capturable mode, or a compiled
step); gradients are zeroed in place, never set to None.

Inactive, with the reason (`blocker`): not on CUDA, several ranks, compile reduce-overhead or
max-autotune, fp16, an optimizer with neither a capturable mode nor a compiled step. A step that
cannot be captured all the same fails the probe as ``unsupported``, naming the knob.
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
