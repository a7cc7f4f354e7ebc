"""The CPU worker's C kernels (the `cpu-kernels` feature): paged decode that reads each sequence's blocks
where they lie, RMSNorm, and the linear layers of small batches.

`kernels/reference.py` is the readable oracle; this is what the torch backend runs on a CPU (tests
hold the two equal, tests/kernels/test_cpu_paged.py). Three cache operations, the reference's signatures:

- `write`: each token's K/V row copied into its slot (a C loop of memcpy, or rounded to bfloat16 as torch
  rounds it; skips slot < 0).
- `decode`: one query per sequence over its first context_lens[i] tokens, in C
  (kernels/cpu_paged.c): per sequence, scores against each block in place (read front to back),
  softmax, weighted sum of the V rows in place. No gather, no padding to the longest context, no mask.
- `prefill`: per sequence, its blocks gathered once (`index_select`; a view instead when they are one
  ascending run) and attended with torch's fused CPU attention (`scaled_dot_product_attention`); the
  gather is shared by all of the chunk's query tokens, so it is small next to the attention itself.

And `linear` (F.linear's arguments) for a batch of at most SMALL_BATCH_ROWS rows, float32 weights: the
weights stream once, each block of 4 weight rows dotted with every input row while it is in cache. A
decode step of a few sequences is all weight reads, and torch's matmul (MKL) read them at 5-10 GB/s at
1-8 rows on an AMD EPYC where this reads 20 GB/s on one thread; from 4 rows up its 4 x 4 blocks are
bound by the multiply-adds, as fast as torch's at 48-64 rows there and faster below (docs/performance.md,
"Batches of up to 64 rows on the C kernels"). Larger batches (long prompts' prefill) stay on torch.
Where the build packs (`panel_width` 32 with AVX-512, 16 with AVX2), the decoder's projections and the
LM head are `pack`ed in place instead and `packed_linear` runs them at every batch size: an
outer-product tile with no reductions, faster than both at every size measured (docs/kernels.md,
"Packed weights"). A `--dtype bfloat16` model's weights are packed too, in pairs: half the bytes, and
with AVX512-BF16 one instruction per pair of multiply-adds; its activations stay bfloat16 in and out.
A float32 model whose weights hold exactly a GGUF's Q4_1 or Q8_0 values (`q4_1_blocks`, `q8_0_blocks`
check every one: the bundled SmolLM2 file's projections and its tied head) gets them packed again in
those bits (`pack_q4`, `pack_q8`: 6 and 9 bits a weight), read by steps of at most `quant_max_rows`
rows (the fused decode layers, `small_rows_linear` for the head), where float32's reads bound the step.
And `rms_norm` (x, weight, eps): one call where torch.rms_norm dispatches about 18 ops. The model takes
both through `use_kernels` (worker/startup/engine_setup.py `use_cpu_kernels`).

And `decode_layers`: a step of at most SMALL_BATCH_ROWS tokens from their ids to the final hidden
states in one C call (the embedding row, RoPE's angles, the kernels above with the K/V write, SiLU and
the residual adds between them, the final norm), where the Python between the kernels was a quarter of
a batch-1 step; worker/engine/fused_decode.py decides when a step takes it.

The cache holds float32 or bfloat16 (`--pa-cache-dtype bfloat16`: half the bytes to read per decoded
token, and twice the tokens per budget); what goes in and comes out is float32 either way (queries, new
K/V rows, outputs, every sum), so a bfloat16 cache changes only what is stored, rounded once when written.

The C file is compiled once per machine and source (`cc -O3 -march=native`, never -ffast-math,
about a second, no torch headers) into a cache folder ($KVPACT_CACHE_DIR, else $XDG_CACHE_HOME/kvpact, else
~/.cache/kvpact) and loaded with ctypes. `load()` returns the operations, or the reason they
cannot run here (no C compiler, a failed build, a float16 cache): the caller keeps
the pure-torch path and says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvpact.kernels import checks

SOURCE = Path(__file__).with_name("cpu_paged.c")
# -ffast-math's parts, but not -ffast-math itself: a shared library linked with it sets flush-to-zero
# for the whole process when loaded (denormals then read as 0 everywhere: a temperature of 1e-45
# became 0 and sampling failed). The compile-only flags let the reductions and exp vectorize.
CFLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffinite-math-only",
    "-fno-signed-zeros",
    "-fassociative-math",
    "-freciprocal-math",
    "-fopenmp-simd",
    "-fPIC",
    "-shared",
    "-pthread",
)
BUILD_TIMEOUT_S = 120.0

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_FLOAT32 = torch.float32
_BF16 = torch.bfloat16
# What the C cache operations store: float32, or bfloat16 (a float32's upper half, widened by a shift).
CACHE_DTYPES = (torch.float32, torch.bfloat16)
# `linear` and `decode_layers` take batches up to this many rows: the whole model's matmuls in C took
# 0.66-0.91x torch's time at 8-32 rows and 0.91-1.08x at 64 on the AMD EPYC it was measured on
# (`python -m benchmarks.small_linear`, docs/performance.md). So a decode step of up to 64 sequences, and
# a step of a 16-token prompt chunk beside up to 48 decodes, run on the C kernels.
SMALL_BATCH_ROWS = 64
QUANT_BLOCK = 32  # input features per Q4_1 block (a GGUF's): one d and one m per output feature each


class Layout(enum.IntEnum):
    """How a projection's weight is laid out, as cpu_paged.c's decode layers take it (its enum)."""

    PLAIN = 0  # [out, in] float32
    PACKED_F32 = 1  # `pack`'s float32 panels
    PACKED_BF16 = 2  # `pack`'s bfloat16 pairs

    @staticmethod
    def of(weight: torch.Tensor) -> Layout:
        """The layout of a projection's weight (`pack` adds a dimension per layout)."""
        return Layout(weight.dim() - 2)


class DecoderLayer(ctypes.Structure):
    """cpu_paged.c's DecoderLayer: one layer's weights (contiguous; norms float32, projections and biases
    float32 or a bfloat16 model's, packed; a bias may be None) and its K/V pools, as raw pointers. The
    tensors must outlive every call that reads them."""

    _fields_ = [
        (name, _ptr)
        for name in (
            "input_norm",
            "qkv",
            "qkv_bias",
            "o",
            "o_bias",
            "post_norm",
            "gate_up",
            "down",
            "key_cache",
            "value_cache",
            "qkv_q4",
            "o_q4",
            "gate_up_q4",
            "down_q4",
        )
    ]


@dataclass(frozen=True, slots=True)
class DecoderShape:
    """What kvp_decode_layers_f32 needs to know of the model besides its pointers."""

    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


@dataclass(frozen=True, slots=True)
class ModelEnds:
    """What kvp_decode_layers_f32 runs before the first layer and after the last: the token embedding
    of `vocab` tokens (float32 or bfloat16, contiguous: [vocab, hidden], or as `pack` laid it out for a
    tied LM head), RoPE's inverse frequencies [head_dim / 2] float32 (RotaryEmbedding's), and the final
    norm's weight [hidden] float32 (None: the caller norms)."""

    embed: torch.Tensor
    vocab: int
    inv_freq: torch.Tensor
    final_norm: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class CpuPagedOps:
    """The loaded kernels; `write`, `decode` and `prefill` take paged.PagedOps' arguments. `num_threads`
    None: the decode splits over torch's thread count on the calling thread at each call (what
    worker/engine/cpu_share.py last set there)."""

    library: ctypes.CDLL
    path: Path
    num_threads: int | None = None
    panel_width: int = 0  # packed weights' panel (kvp_panel_width); 0: this build packs none
    q4_block_bytes: int = 0  # a Q4_1 block of a packed panel (kvp_q4_block_bytes); 0: none packs
    q8_block_bytes: int = 0  # a Q8_0 block of a packed panel (kvp_q8_block_bytes); 0: none packs
    quant_max_rows: int = 0  # at most this many rows read Q4_1 / Q8_0 panels (kvp_quant_max_rows)

    def write(self, key, value, key_cache, value_cache, slot_mapping, *, check=True) -> None:  # noqa: ANN001
        """key, value float32 [num_tokens, kv_heads, head_dim] into a float32 or bfloat16 cache."""
        row = key_cache.shape[2] * key_cache.shape[3]
        if check:
            checks.check_cache_write(key, value, key_cache, value_cache, slot_mapping, rows_dtype=_FLOAT32)
            _check_layout(key_cache, key=key, value=value)
            if key.shape[0] and int(slot_mapping.max()) >= key_cache.shape[0] * key_cache.shape[1]:
                raise ValueError(f"slot_mapping holds slot {int(slot_mapping.max())}, past the cache's end")
        with _traced("kvpact::cpu_paged_write"):
            self.library.kvp_write_f32(
                key.data_ptr(),
                key.stride(0),
                value.data_ptr(),
                value.stride(0),
                key_cache.data_ptr(),
                value_cache.data_ptr(),
                slot_mapping.data_ptr(),
                slot_mapping.shape[0],
                row,
                key_cache.dtype is torch.bfloat16,
            )

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear for x [rows <= SMALL_BATCH_ROWS, in] and float32 CPU weights [out, in] (contiguous,
        as a loaded model's are); any other call goes to F.linear itself. Called for every projection
        of a small step, so the checks are the cheap ones that keep the C code's reads in bounds."""
        rows = x.shape[0]
        out_features, in_features = weight.shape
        if (
            rows > SMALL_BATCH_ROWS
            or x.dim() != 2
            or x.shape[1] != in_features
            or x.dtype is not _FLOAT32
            or weight.dtype is not _FLOAT32
            or not (x.is_cpu and weight.is_cpu and weight.is_contiguous())
            or not _bias_fits(bias, out_features)
        ):
            return F.linear(x, weight, bias)
        x = x.contiguous()
        out = torch.empty(rows, out_features, dtype=_FLOAT32)
        self._run_linear(self.library.kvp_linear_f32, x, weight, bias, out)
        return out

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [out, in] (CPU) laid out for `packed_linear`, in panels of `panel_width` output
        features (cpu_paged.c, "packed"). Float32: [out / panel_width, in, panel_width], panel p holding
        output features p * panel_width onwards, input feature by input feature. Bfloat16 (a
        `--dtype bfloat16` model's; `in` even): [out / panel_width, in / 2, panel_width, 2], each
        output feature's weights for input features 2i and 2i + 1 side by side (one 32-bit word).
        Only where `packs`."""
        if not self.panel_width:
            raise ValueError(
                "this build of the C kernels packs no weights (kvp_panel_width 0: no AVX-512 or AVX2)"
            )
        if not self.packs(weight):
            raise ValueError(
                f"cannot pack a {weight.dtype} weight of shape {tuple(weight.shape)} on {weight.device}: "
                f"the packed kernel takes float32 or bfloat16 CPU [out, in] with out a multiple of "
                f"{self.panel_width} (and in even for bfloat16)"
            )
        out_features, in_features = weight.shape
        panels = weight.detach().reshape(out_features // self.panel_width, self.panel_width, in_features)
        if weight.dtype is _BF16:
            return panels.reshape(*panels.shape[:2], in_features // 2, 2).transpose(1, 2).contiguous()
        return panels.transpose(1, 2).contiguous()

    @staticmethod
    def unpack(packed: torch.Tensor) -> torch.Tensor:
        """`pack`'s float32 panels [out / W, in, W] back as [out, in] (a copy): what `pack_q4` and
        `pack_q8` read of a weight that was packed first."""
        return packed.transpose(1, 2).reshape(-1, packed.shape[1])

    def packs(self, weight: torch.Tensor) -> bool:
        """Whether `pack` takes this weight: a build with panels, float32 or bfloat16 CPU [out, in], out
        a multiple of the panel width (every projection of the Llama-family models measured), in even
        for bfloat16."""
        return (
            self.panel_width > 0
            and weight.dim() == 2
            and weight.shape[1] > 0
            and weight.shape[0] % self.panel_width == 0
            and (weight.dtype is _FLOAT32 or (weight.dtype is _BF16 and weight.shape[1] % 2 == 0))
            and weight.is_cpu
        )

    def packed_linear(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """F.linear(x, weight, bias) where `packed` is `pack(weight)`, for any number of rows: torch has
        no matmul for this layout, so every call of a packed projection runs here, prefill chunks
        included. x [..., in] on the CPU, and the bias, of the weight's dtype; so is the result
        (bfloat16: float32 sums, each rounded once, as torch's bf16 matmul rounds them)."""
        bf16 = packed.dtype is _BF16
        dtype = _BF16 if bf16 else _FLOAT32
        name = "bfloat16" if bf16 else "float32"
        layout = (packed.dim() == 4 and packed.shape[3] == 2) if bf16 else packed.dim() == 3
        if (
            not layout
            or packed.shape[2] != self.panel_width
            or packed.shape[1] == 0
            or packed.dtype is not dtype
            or not packed.is_cpu
            or not packed.is_contiguous()
        ):
            raise ValueError(
                f"packed_linear: the weight must be `pack`'s contiguous CPU [out / {self.panel_width}, in, "
                f"{self.panel_width}] (float32) or [out / {self.panel_width}, in / 2, {self.panel_width}, 2] "
                f"(bfloat16), got {packed.dtype} {tuple(packed.shape)} on {packed.device}"
            )
        panels, width = packed.shape[0], packed.shape[2]
        in_features = packed.shape[1] * (2 if bf16 else 1)
        out_features = panels * width
        if x.shape[-1] != in_features or x.dtype is not dtype or not x.is_cpu:
            raise ValueError(
                f"packed_linear: x must be {name} on the CPU with {in_features} features (the weight's "
                f"dtype), got {x.dtype} {tuple(x.shape)} on {x.device}"
            )
        if not _bias_fits(bias, out_features, dtype):
            raise ValueError(f"packed_linear: bias must be a contiguous {name} CPU [{out_features}]")
        rows = x.numel() // in_features
        flat = x.reshape(rows, in_features).contiguous()
        out = torch.empty(*x.shape[:-1], out_features, dtype=dtype)
        kernel = self.library.kvp_linear_packed_bf16 if bf16 else self.library.kvp_linear_packed_f32
        self._run_linear(kernel, flat, packed, bias, out.view(rows, out_features))
        return out

    def q8_0_blocks(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """weight [out, in] float32 as Q8_0 blocks: (q int8 [out, in] in -127..127, d float32 [out, in /
        QUANT_BLOCK], each a float16's value) with d * q == weight exactly (a float16 times an int8 is
        exact in float32: what the gguf package's dequantization gave), or None where some block is not.
        d: the quantizer's, the block's largest |weight| / 127 (`exact_blocks`)."""
        blocks = _blocks(weight)
        if blocks is None:
            return None
        zero = torch.zeros(blocks.shape[:2], dtype=_FLOAT32)
        found = self.exact_blocks(blocks, zero, blocks.abs().amax(dim=2) / 127, -127, 127)
        return None if found is None else (found[0].reshape(weight.shape), found[1])

    def q4_1_blocks(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """weight [out, in] float32 as Q4_1 blocks: (q uint8 [out, in] in 0..15, d and m float32 [out,
        in / QUANT_BLOCK], each a float16's value) with d * q + m == weight exactly, the product rounded
        to float32 and then the sum, as the gguf package dequantizes (what the loader did to a Q4_1
        file). None where some block is not: the weights were not dequantized from Q4_1, or were changed
        since. A block's smallest weight is its m (its q is 0: the quantizer maps the minimum there); d:
        the quantizer's, (max - m) / 15 (`exact_blocks`)."""
        blocks = _blocks(weight)
        if blocks is None:
            return None
        m, top = torch.aminmax(blocks, dim=2)
        if not torch.equal(m.half().float(), m):
            return None
        found = self.exact_blocks(blocks, m, (top - m) / 15, 0, 15)
        return None if found is None else (found[0].view(torch.uint8).reshape(weight.shape), found[1], m)

    def exact_blocks(
        self, blocks: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, lowest: int, highest: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(levels int8 [out, blocks, QUANT_BLOCK], d float32 [out, blocks]) with d * levels + base ==
        blocks exactly for every block (float32, product then sum, as the gguf package dequantizes),
        levels whole numbers in [lowest, highest] and d a float16's value: the float16 nearest `scale`
        (the quantizer's d before it was rounded to float16) or one of its four neighbours. None when a
        block has none (a tensor that was never these blocks stops at its first block). One pass in C
        (kvp_exact_blocks), where the same search in torch's elementwise ops was most of the packing's
        time (docs/performance.md, "Startup in C, and what one message costs").
        blocks, base and scale: float32 CPU tensors, [out, blocks, QUANT_BLOCK] and [out, blocks], finite
        (a caller's check: the library assumes finite math); ValueError otherwise."""
        num_blocks = blocks.shape[:-1]
        if not (
            blocks.dim() == 3 and blocks.shape[2] == QUANT_BLOCK and base.shape == scale.shape == num_blocks
        ):
            raise ValueError(
                f"exact_blocks: blocks must be [out, blocks, {QUANT_BLOCK}] and base and scale [out, "
                f"blocks], got {tuple(blocks.shape)}, {tuple(base.shape)} and {tuple(scale.shape)}"
            )
        if any(t.dtype is not _FLOAT32 or t.device.type != "cpu" for t in (blocks, base, scale)):
            raise ValueError("exact_blocks: blocks, base and scale must be float32 CPU tensors")
        if not -128 <= lowest <= highest <= 127:
            raise ValueError(f"exact_blocks: levels {lowest}..{highest} do not fit an int8")
        # held here, not made inside the call's arguments: a copy would be freed before C reads it
        blocks, base, scale = blocks.contiguous(), base.contiguous(), scale.contiguous()
        levels = torch.empty(blocks.shape, dtype=torch.int8)
        d = torch.empty(num_blocks, dtype=_FLOAT32)
        missed = self.library.kvp_exact_blocks(
            blocks.data_ptr(),
            blocks.shape[0],
            blocks.shape[1] * QUANT_BLOCK,
            base.data_ptr(),
            scale.data_ptr(),
            lowest,
            highest,
            levels.data_ptr(),
            d.data_ptr(),
        )
        return None if missed else (levels, d)

    def pack_q4(self, weight: torch.Tensor) -> torch.Tensor | None:
        """weight [out, in] (float32, CPU) as Q4_1 panels for `packed_linear_q4` and the decode layers
        (cpu_paged.c, "Q4_1 weights"), or None where it is not exactly Q4_1 (`q4_1_blocks`) or not of a
        shape that packs (out a multiple of the panel width, in of QUANT_BLOCK). uint8 [out / panel_width,
        in / QUANT_BLOCK, q4_block_bytes]."""
        if not self.q4_block_bytes or weight.dim() != 2 or weight.shape[0] % self.panel_width:
            return None
        blocks = self.q4_1_blocks(weight)
        if blocks is None:
            return None
        q, d, m = blocks
        (out_features, in_features), width, half = weight.shape, self.panel_width, self.panel_width // 2
        panels, num_blocks = out_features // width, in_features // QUANT_BLOCK
        # byte j of an input feature's row: output j's q low, output half + j's high
        q = q.reshape(panels, 2, half, num_blocks, QUANT_BLOCK)
        nibbles = (
            (q[:, 0] | (q[:, 1] << 4)).permute(0, 2, 3, 1).reshape(panels, num_blocks, QUANT_BLOCK * half)
        )

        def per_block(t: torch.Tensor) -> torch.Tensor:  # [out, blocks] -> [panels, blocks, 4 * width]
            return t.reshape(panels, width, num_blocks).transpose(1, 2).contiguous().view(torch.uint8)

        packed = torch.cat([nibbles, per_block(d), per_block(m)], dim=2).contiguous()
        assert packed.shape[2] == self.q4_block_bytes, (packed.shape, self.q4_block_bytes)
        return packed

    def pack_q8(self, weight: torch.Tensor) -> torch.Tensor | None:
        """weight [out, in] (float32, CPU) as Q8_0 panels for `packed_linear_q8` (cpu_paged.c, "Q8_0
        weights"), or None where it is not exactly Q8_0 (`q8_0_blocks`) or not of a shape that packs.
        uint8 [out / panel_width, in / QUANT_BLOCK, q8_block_bytes]."""
        if not self.q8_block_bytes or weight.dim() != 2 or weight.shape[0] % self.panel_width:
            return None
        blocks = self.q8_0_blocks(weight)
        if blocks is None:
            return None
        q, d = blocks
        (out_features, in_features), width = weight.shape, self.panel_width
        panels, num_blocks = out_features // width, in_features // QUANT_BLOCK
        values = (
            q.reshape(panels, width, num_blocks, QUANT_BLOCK)
            .permute(0, 2, 3, 1)
            .reshape(panels, num_blocks, -1)
        )
        scales = d.reshape(panels, width, num_blocks).transpose(1, 2).contiguous().view(torch.uint8)
        packed = torch.cat([values.view(torch.uint8), scales], dim=2).contiguous()
        assert packed.shape[2] == self.q8_block_bytes, (packed.shape, self.q8_block_bytes)
        return packed

    def packed_linear_q4(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """F.linear(x, weight, bias) where `packed` is `pack_q4(weight)`: x [rows, in] float32 CPU."""
        return self._packed_quantized("q4", self.q4_block_bytes, x, packed, bias)

    def packed_linear_q8(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """F.linear(x, weight, bias) where `packed` is `pack_q8(weight)`: x [rows, in] float32 CPU."""
        return self._packed_quantized("q8", self.q8_block_bytes, x, packed, bias)

    def small_rows_linear(
        self, quantized: torch.Tensor
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]:
        """A packed projection's matmul that reads `quantized` (its `pack_q8`) for at most
        `quant_max_rows` rows (the weights' reads bound those) and the float32 panels it is given for
        more (the multiply-adds bound those): the LM head's, whose rows are a step's sampled ones."""

        def matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            if x.dim() == 2 and x.shape[0] <= self.quant_max_rows:
                return self.packed_linear_q8(x, quantized, bias)
            return self.packed_linear(x, packed, bias)

        return matmul

    def _packed_quantized(
        self,
        kind: str,  # "q4" or "q8": the kernel kvp_linear_packed_<kind>, the packing pack_<kind>
        block_bytes: int,
        x: torch.Tensor,
        packed: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        panels, num_blocks, got_bytes = packed.shape
        out_features, in_features = panels * self.panel_width, num_blocks * QUANT_BLOCK
        name = f"packed_linear_{kind}"
        if packed.dtype is not torch.uint8 or got_bytes != block_bytes or not packed.is_contiguous():
            raise ValueError(f"{name}: the weight must be `pack_{kind}`'s, got {packed.dtype} {packed.shape}")
        if x.dim() != 2 or x.shape[1] != in_features or x.dtype is not _FLOAT32 or not x.is_cpu:
            raise ValueError(f"{name}: x must be float32 CPU [rows, {in_features}], got {x.shape}")
        if not _bias_fits(bias, out_features):
            raise ValueError(f"{name}: bias must be a contiguous float32 CPU [{out_features}]")
        x = x.contiguous()
        out = torch.empty(x.shape[0], out_features, dtype=_FLOAT32)
        self._run_linear(getattr(self.library, f"kvp_linear_packed_{kind}"), x, packed, bias, out)
        return out

    def _run_linear(
        self,
        kernel: Callable[..., None],
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        """out [rows, n] = x [rows, k] (contiguous) through one of the C linear kernels, whose arguments
        they all share (x, rows, weight, bias, n, k, out, threads), on `weight` in its layout; n and k
        are out's and x's. Under the profiler's kvpact::cpu_linear range (the engine_step suite's
        matmuls)."""
        rows, in_features = x.shape
        if not rows:
            return
        with _traced("kvpact::cpu_linear"):
            kernel(
                x.data_ptr(),
                rows,
                weight.data_ptr(),
                None if bias is None else bias.data_ptr(),
                out.shape[1],
                in_features,
                out.data_ptr(),
                self.num_threads or torch.get_num_threads(),
            )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """torch.rms_norm over x's last dimension for a contiguous float32 CPU x [rows, dim] and weight
        [dim]; anything else goes to torch.rms_norm itself."""
        if (
            x.dim() != 2
            or x.dtype is not _FLOAT32
            or weight.dtype is not _FLOAT32
            or not x.is_cpu
            or not weight.is_cpu
            or not x.is_contiguous()
            or not weight.is_contiguous()
            or weight.shape[0] != x.shape[1]
        ):
            return torch.rms_norm(x, weight.shape, weight, eps)
        out = torch.empty_like(x)
        with _traced("kvpact::cpu_rms_norm"):
            self.library.kvp_rms_norm_f32(
                x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps, out.data_ptr()
            )
        return out

    def decode_layers(  # noqa: PLR0913 - the C function's arguments
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        ends: ModelEnds,
        layers: ctypes.Array[DecoderLayer],
        shape: DecoderShape,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        num_slots: int,
        layout: Layout = Layout.PLAIN,
        cache_bf16: bool = False,
    ) -> torch.Tensor:
        """The final hidden states [rows, hidden] float32 of a step of `rows` tokens (token_ids, positions
        int64 [rows]) through the embedding (`ends`), every layer of `layers` and the final norm (`ends`:
        none when its `final_norm` is None, the residual stream then). Each token is written to its slot
        (slot_mapping int64 [rows]), then attends over its first context_lens[i] tokens through its row
        of block_tables: decodes one new token each, a prompt chunk's tokens a row each (context: its
        position + 1). num_slots: the pools' blocks x block_size. layout: the layers' projections'
        (PACKED_BF16: a bfloat16 model's, biases bfloat16 too; its norm weights given as float32
        copies, the residual stream float32 all the same). cache_bf16: the pools hold bfloat16 (else
        float32). The caller (worker/engine/fused_decode.py) built `ends` and `layers` from tensors it
        checked and keeps alive; here the step's own tensors are checked (their ids, slots and contexts'
        values in C, before any layer runs), as decode and write check theirs on a step's first layer."""
        rows = token_ids.shape[0]
        for name, t, dtype, shape_ in (
            ("token_ids", token_ids, torch.int64, (rows,)),
            ("positions", positions, torch.int64, (rows,)),
            ("slot_mapping", slot_mapping, torch.int64, (rows,)),
            ("block_tables", block_tables, torch.int32, (rows, block_tables.shape[-1])),
            ("context_lens", context_lens, torch.int32, (rows,)),
        ):
            if t.dtype != dtype or tuple(t.shape) != shape_ or not t.is_cpu or not t.is_contiguous():
                raise ValueError(
                    f"decode_layers: {name} must be a contiguous {dtype} CPU tensor of shape {shape_}, "
                    f"got {t.dtype} {tuple(t.shape)} on {t.device}"
                )
        x = torch.empty(rows, shape.hidden)
        if rows == 0:
            return x
        with _traced("kvpact::cpu_decode_layers"):
            status = self.library.kvp_decode_layers_f32(
                x.data_ptr(),
                rows,
                token_ids.data_ptr(),
                positions.data_ptr(),
                ends.embed.data_ptr(),
                ends.embed.dtype is torch.bfloat16,
                ends.embed.shape[2] if ends.embed.dim() > 2 else 0,
                ends.vocab,
                ends.inv_freq.data_ptr(),
                None if ends.final_norm is None else ends.final_norm.data_ptr(),
                layers,
                len(layers),
                shape.hidden,
                shape.q_heads,
                shape.kv_heads,
                shape.head_dim,
                shape.intermediate,
                shape.eps,
                shape.scale,
                slot_mapping.data_ptr(),
                num_slots,
                block_tables.data_ptr(),
                block_tables.stride(0),
                context_lens.data_ptr(),
                block_size,
                self.num_threads or torch.get_num_threads(),
                int(layout),
                int(cache_bf16),
            )
        if status == 1:
            raise MemoryError("the C decode layers could not allocate their step buffers")
        if status:
            refused = {
                2: f"a token id is outside the vocabulary [0, {ends.vocab})",
                3: f"slot_mapping holds a slot past the cache's end ({num_slots} slots)",
                4: "context_lens must be >= 1 (the token is in the cache)",
            }
            raise ValueError(f"decode_layers: {refused[status]}")
        return x

    def decode(  # noqa: ANN001 - the reference's arguments
        self,
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        scale,
        num_splits=None,
        *,
        out=None,
        check=True,
        **_,
    ) -> torch.Tensor:
        """query float32 [num_seqs, q_heads, head_dim] over a float32 or bfloat16 cache; out float32."""
        num_seqs, q_heads, head_dim = query.shape
        _, block_size, kv_heads, _ = key_cache.shape
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype)
        if check:
            checks.check_decode(
                query, key_cache, value_cache, block_tables, context_lens, rows_dtype=_FLOAT32
            )
            checks.check_out("out", out, query)
            _check_layout(key_cache, query=query, out=out)
            if num_seqs and int(context_lens.min()) < 1:
                raise ValueError("context_lens must be >= 1 (the decoded token is in the cache)")
        if num_seqs == 0:
            return out
        with _traced("kvpact::cpu_paged_decode"):
            status = self.library.kvp_decode_f32(
                query.data_ptr(),
                query.stride(0),
                key_cache.data_ptr(),
                value_cache.data_ptr(),
                block_tables.data_ptr(),
                block_tables.stride(0),
                context_lens.data_ptr(),
                num_seqs,
                q_heads,
                kv_heads,
                head_dim,
                block_size,
                float(scale),
                out.data_ptr(),
                self.num_threads or torch.get_num_threads(),
                key_cache.dtype is torch.bfloat16,
            )
        if status:
            raise MemoryError("the CPU paged decode kernel could not allocate its score buffer")
        return out

    def prefill(  # noqa: ANN001 - the reference's arguments
        self,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        context_lens,
        scale,
        max_query_len=None,
        *,
        out=None,
        key=None,
        value=None,
        **_,
    ) -> torch.Tensor:
        return prefill_attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            query_start_loc,
            context_lens,
            scale,
            out=out,
            key=key,
            value=value,
        )


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, q_heads, head_dim], sequences back to back
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference's prefill (paged_prefill_attention_torch), one gather per sequence and torch's
    fused attention instead of explicit scores, in query's dtype over any cache dtype (a bfloat16
    prefix is widened as it is gathered). `key`/`value` [num_tokens, kv_heads, head_dim], when given,
    are the new tokens' K/V laid out like `query` (already written to the cache): a sequence with no
    cached prefix (q_len == context_len) attends on them, and gathers nothing."""
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    starts = query_start_loc.tolist()
    for i, context_len in enumerate(context_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        mask = None  # q_len == context_len: plain causal
        if key is not None and value is not None and q_len == context_len:
            k, v = key[start:end], value[start:end]
        else:
            k, v = _context(key_cache, value_cache, block_tables[i], context_len)
        k, v = k.to(query.dtype), v.to(query.dtype)  # a no-op but for a bfloat16 cache's prefix
        if q_len != context_len:  # a cached prefix: query j sits at context_len - q_len + j
            q_pos = torch.arange(context_len - q_len, context_len, device=query.device)
            mask = torch.arange(context_len, device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            query[start:end].transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = o[0].transpose(0, 1)
    return out


def _context(
    key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's first context_len K/V rows [context_len, kv_heads, head_dim]: a view of the pools
    when its blocks are one ascending run (the block manager hands a sequence's chunks consecutive
    blocks while no other sequence allocates in between), else gathered (`index_select`). Measured, one
    layer of a 64- or 512-token chunk over a 1024-1464-token context: 3-30% less CPU on the view than
    gathered (docs/performance.md)."""
    _, block_size, kv_heads, head_dim = key_cache.shape
    num_blocks = -(-context_len // block_size)
    ids = table[:num_blocks]
    first = int(ids[0])
    if int(ids[-1]) - first == num_blocks - 1 and ids.tolist() == list(range(first, first + num_blocks)):
        k, v = key_cache[first : first + num_blocks], value_cache[first : first + num_blocks]
    else:
        k, v = key_cache.index_select(0, ids.long()), value_cache.index_select(0, ids.long())
    return k.view(-1, kv_heads, head_dim)[:context_len], v.view(-1, kv_heads, head_dim)[:context_len]


_UNTRACED = contextlib.nullcontext()


def _traced(name: str) -> contextlib.AbstractContextManager[object]:
    """A profiler range named `name` while torch.profiler records (the engine_step benchmark groups the
    kernels by it); nothing otherwise: entering a range costs a dispatch, twice per layer per step."""
    return torch.profiler.record_function(name) if torch._C._autograd._profiler_enabled() else _UNTRACED


def _bias_fits(bias: torch.Tensor | None, out_features: int, dtype: torch.dtype = _FLOAT32) -> bool:
    """None, or what the C linear kernels read as a bias: a contiguous CPU [out_features] of `dtype`."""
    return bias is None or (
        bias.dtype is dtype and bias.shape == (out_features,) and bias.is_cpu and bias.is_contiguous()
    )


def _check_layout(key_cache: torch.Tensor, **rows: torch.Tensor) -> None:
    """What the C code assumes beyond kernels/checks.py: a contiguous float32 or bfloat16 cache on the
    CPU, and each token's [heads, head_dim] block contiguous (tokens may be any stride apart)."""
    if key_cache.dtype not in CACHE_DTYPES or key_cache.device.type != "cpu" or not key_cache.is_contiguous():
        raise ValueError(
            f"the C kernels need a contiguous float32 or bfloat16 CPU cache, got {key_cache.dtype} "
            f"on {key_cache.device}, strides {key_cache.stride()}"
        )
    for name, t in rows.items():
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError(
                f"{name}: each token's [heads, head_dim] must be contiguous, strides {t.stride()}"
            )


def load(dtype: torch.dtype, device: torch.device) -> CpuPagedOps | str:
    """The compiled kernels, or why they cannot run (the caller falls back to pure torch)."""
    if device.type != "cpu":
        return f"the C kernels run on CPU tensors, the cache is on {device.type}"
    if dtype not in CACHE_DTYPES:
        return f"the C kernels take a float32 or bfloat16 cache, not {str(dtype).removeprefix('torch.')}"
    try:
        path = _build()
        library = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        return f"could not build {SOURCE.name}: {e}"
    library.kvp_write_f32.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64]
    library.kvp_write_f32.restype = None
    library.kvp_decode_f32.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64]
    library.kvp_decode_f32.argtypes += [_f32, _ptr, _i64, _i64]
    library.kvp_decode_f32.restype = ctypes.c_int
    library.kvp_linear_f32.argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _i64, _ptr, _i64]
    library.kvp_linear_f32.restype = None
    library.kvp_rms_norm_f32.argtypes = [_ptr, _i64, _i64, _ptr, _f32, _ptr]
    library.kvp_rms_norm_f32.restype = None
    library.kvp_decode_layers_f32.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr]
    library.kvp_decode_layers_f32.argtypes += [ctypes.POINTER(DecoderLayer), _i64, _i64, _i64, _i64, _i64]
    library.kvp_decode_layers_f32.argtypes += [_i64, _f32, _f32]
    library.kvp_decode_layers_f32.argtypes += [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64]
    library.kvp_decode_layers_f32.restype = ctypes.c_int
    library.kvp_linear_packed_f32.argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _i64, _ptr, _i64]
    library.kvp_linear_packed_f32.restype = None
    library.kvp_linear_packed_bf16.argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _i64, _ptr, _i64]
    library.kvp_linear_packed_bf16.restype = None
    for name in ("kvp_linear_packed_q4", "kvp_linear_packed_q8"):
        getattr(library, name).argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _i64, _ptr, _i64]
        getattr(library, name).restype = None
    library.kvp_panel_width.argtypes = []
    library.kvp_panel_width.restype = _i64
    library.kvp_exact_blocks.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr, _ptr]
    library.kvp_exact_blocks.restype = _i64
    for name in ("kvp_q4_block_bytes", "kvp_q8_block_bytes", "kvp_quant_max_rows"):
        getattr(library, name).argtypes = []
        getattr(library, name).restype = _i64
    return CpuPagedOps(
        library,
        path,
        panel_width=int(library.kvp_panel_width()),
        q4_block_bytes=int(library.kvp_q4_block_bytes()),
        q8_block_bytes=int(library.kvp_q8_block_bytes()),
        quant_max_rows=int(library.kvp_quant_max_rows()),
    )


def _blocks(weight: torch.Tensor) -> torch.Tensor | None:
    """A float32 [out, in] CPU weight as [out, in / QUANT_BLOCK, QUANT_BLOCK], or None when it is not one
    or holds a value that is not finite (no GGUF block dequantizes to one)."""
    if (
        weight.dim() != 2
        or weight.dtype is not _FLOAT32
        or weight.device.type != "cpu"
        or weight.shape[1] % QUANT_BLOCK
        or not weight.numel()
        or not bool(torch.isfinite(weight).all())
    ):
        return None
    return weight.detach().reshape(weight.shape[0], -1, QUANT_BLOCK)


def required(dtype: torch.dtype, device: torch.device) -> CpuPagedOps:
    """The kernels for a cache whose plan realized --cpu-kernels: its checks (worker/startup/checks.py)
    ran `load` before any weight, so here they load, or the plan and the build disagree (a bug)."""
    loaded = load(dtype, device)
    if isinstance(loaded, str):
        raise RuntimeError(f"the plan realized --cpu-kernels, but the cache cannot run them: {loaded}")
    return loaded


def cache_dir() -> Path:
    if os.environ.get("KVPACT_CACHE_DIR"):
        return Path(os.environ["KVPACT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvpact"


def _build() -> Path:
    """The shared library for this source, flags and CPU, built once (atomically) into cache_dir()."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (install gcc, or set CC)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join((compiler, *CFLAGS)).encode() + _cpu_id().encode()).hexdigest()
    target = cache_dir() / f"cpu_paged-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run(
            [compiler, *CFLAGS, "-o", str(built), str(SOURCE), "-lm"],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} exited {done.returncode}: {done.stderr.strip()[-400:]}")
        os.replace(built, target)  # atomic: concurrent workers see a whole file or none
    return target


def _cpu_id() -> str:
    """What -march=native depends on: the machine and its CPU flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return platform.machine() + flags
