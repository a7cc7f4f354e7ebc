"""What the step loop needs from an accelerator: its thread bound to the device, host tensors copied
there without a stream sync (the step loop's only sync should be reading the sampled token ids back).
Both are no-ops or plain copies on the CPU and MPS.
"""

from __future__ import annotations

import torch


def bind_thread(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (a no-op elsewhere). Every thread that
    launches kernels on `cuda:N` needs this: a new thread starts on cuda:0, and Triton launches on
    the current device whatever device its tensors are on."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on the CPU) on `device`. On CUDA the copy goes through pinned memory and does not
    synchronize the stream, so it queues behind the kernels already launched."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
