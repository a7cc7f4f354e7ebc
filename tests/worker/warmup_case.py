"""Run by tests/worker/test_kernel_warmup.py in a subprocess with TRITON_INTERPRET=1 (set before triton
is imported). Warms up a Triton PagedCache on the CPU while recording every kernel launch's constexprs,
then builds the steps a server could build (every decode batch size and block-table width up to
max_model_len) and records the split count each picks. Prints JSON.
"""

from __future__ import annotations

import json
import sys

import torch

from kvpact.kernels import cache_write, decode_attention, prefill_attention
from kvpact.shared.intent import PagedBackend
from kvpact.worker.kv.paged import PagedAttentionStep, PagedCache
from kvpact.worker.startup.kernel_warmup import warm_up_paged_kernels

HEADS, KV_HEADS, DIM = 4, 2, 32


class RecordingKernel:
    """Test-side spy around an interpreted kernel: records each launch's NUM_SPLITS (or its name)."""

    def __init__(self, name: str, kernel, launches: list[str]) -> None:  # noqa: ANN001
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        launch = self.kernel[grid]

        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            splits = kwargs.get("NUM_SPLITS")
            self.launches.append(self.name + (f" splits={splits}" if splits is not None else ""))
            return launch(*args, **kwargs)

        return run


def main() -> None:
    block_size, max_model_len, max_num_seqs = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    launches: list[str] = []
    for module, name in (
        (cache_write, "kernel_reshape_and_cache"),
        (decode_attention, "kernel_paged_decode_attention"),
        (decode_attention, "kernel_merge_splits"),
        (prefill_attention, "kernel_paged_prefill_attention"),
    ):
        setattr(module, name, RecordingKernel(name.removeprefix("kernel_"), getattr(module, name), launches))
    num_blocks = max_model_len // block_size + 2
    cache = PagedCache(
        2, num_blocks, block_size, KV_HEADS, DIM, torch.float32, torch.device("cpu"), PagedBackend.TRITON,
        max_model_len=max_model_len,
    )  # fmt: skip
    report = warm_up_paged_kernels(cache, num_heads=HEADS, dtype=torch.float32)
    picked = set()
    max_blocks = -(-max_model_len // block_size)
    for num_decodes in range(1, max_num_seqs + 1):
        for width in range(1, max_blocks + 1):
            # the longest decode has `width` blocks, the others one
            tables = [list(range(width))] + [[0]] * (num_decodes - 1)
            step = PagedAttentionStep(cache, tables, [width * block_size - 1] + [0] * (num_decodes - 1),
                                      [1] * num_decodes, num_decodes)  # fmt: skip
            picked.add(step.decode_splits)
    print(
        json.dumps(
            {
                "variants": list(report.variants),
                "split_variants": list(cache.split_variants),
                "launches": sorted(set(launches)),
                "picked": sorted(picked),
                "compiled": report.compiled,
                "compiles_after_ready": cache.kernel_compiles_after_ready(),
            }
        )
    )


if __name__ == "__main__":
    main()
