"""Block sizes for the kernels: a heuristic default, overridden by tuned tables (data).

Tuned tables are JSON files under ``tuned/``, one per device kind, written by tuning
scripts under ``benchmarks/``. Each holds ``device_kind`` (as ``jax.Device.device_kind``
reports it), ``source`` (how the numbers were obtained) and ``entries``: a list of
objects whose ``match`` keys select a configuration and whose other keys are the block
sizes. A miss falls back to the heuristic.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
from typing import Any

import numpy as np

TUNED_DIR = pathlib.Path(__file__).parent / "tuned"

GPU_MATCH_KEYS = ("mode", "head_size", "group", "page_size", "q_dtype", "kv_dtype")
"""What a GPU table entry matches on; ``mode`` is one of ``GPU_LAUNCH_MODES``, the dtypes are
NumPy names ("bfloat16", "float8_e4m3fn", ...): an entry tuned for 16-bit data never serves float32."""

GPU_MODES = ("decode", "prefill", "mixed")
"""decode: every request has at most one new token; prefill: none has exactly one; mixed: both."""

GPU_LAUNCH_MODES = ("decode", "mixed")
"""The Triton launches whose blocks ``gpu_block_choice`` chooses and a table entry tunes: a
prefill batch runs the mixed one, its decode part empty (``pallas_gpu.launch_mode``)."""

H100_NUM_SMS = 132


def gpu_batch_mode(query_lens: np.ndarray) -> str:
    """The ``GPU_MODES`` entry of a batch from its i32[R] query lengths (empty requests ignored)."""
    real = query_lens[query_lens > 0]
    if (real <= 1).all():
        return "decode"
    return "prefill" if (real > 1).all() else "mixed"


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
    """Static tiling of one launch.

    block_q: query tokens per q-block; ``block_q * next_pow2(G)`` rows, at least 16.
    pages_per_tile: pages per K/V tile (tile = pages_per_tile * page_size keys, >= 16).
    keys_per_tile: a K/V tile of part of a page (a power of two below the page size, >= 16;
    ``pages_per_tile`` must then be 1), for pages too large for shared memory; None: whole pages.
    num_kv_splits: flash-decoding splits of each q-block's KV range (1 = one pass).
    num_warps, num_stages: Triton's warps per program and software-pipelining depth.
    kv_heads_per_program: adjacent KV heads one program attends together, their columns
    read as one tile of ``head_tile(D * kv_heads_per_program)`` (narrow heads: fewer masked
    lanes per key); rows are ``block_q * next_pow2(kv_heads_per_program) * next_pow2(G)``.
    Packed heads share their tiles' dots: a non-finite cached key or value may reach the rows
    of the heads packed with it in its request (never other requests, nor rows that do not
    see its position).
    """

    block_q: int
    pages_per_tile: int
    num_kv_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    keys_per_tile: int | None = None
    kv_heads_per_program: int = 1

    def tile(self, page_size: int) -> int:
        """Keys per K/V tile."""
        return self.keys_per_tile or self.pages_per_tile * page_size

    def rows(self, group: int) -> int:
        """Query rows per program: tokens x packed KV heads x the head group, each padded to a power of two."""
        return self.block_q * next_pow2(self.kv_heads_per_program) * next_pow2(group)


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def head_tile(head_size: int) -> int:
    """The power-of-two tile width the Triton kernel loads a head of ``head_size`` elements
    into (>= 16: a dot's minimum); the columns past ``head_size`` are masked off."""
    return max(16, next_pow2(head_size))


GPU_SMEM_BYTES = {"H100": 232448, "H200": 232448, "H800": 232448, "H20": 232448, "GH200": 232448,
                  "A100": 166912, "A800": 166912, "A30": 166912, "B200": 232448}  # fmt: skip
"""Shared memory a block may opt into (bytes) by device family; the H100's figure is the one
its runtime reports ("available: 232448")."""

DEFAULT_GPU_SMEM_BYTES = 101376
"""For GPUs not in ``GPU_SMEM_BYTES`` (and the interpreter): the 99 KiB of sm_86/sm_89, the
smallest limit of the GPUs Triton serves."""


def gpu_smem_limit(device_kind: str | None) -> int:
    """The shared-memory budget of one program on ``device_kind`` (``jax.Device.device_kind``)."""
    for family, limit in GPU_SMEM_BYTES.items():
        if device_kind is not None and f" {family} " in f" {device_kind} ".replace("-", " "):
            return limit
    return DEFAULT_GPU_SMEM_BYTES


def triton_smem_bytes(bs: GpuBlockSizes, *, group: int, page_size: int, head_size: int, q_dtype, kv_dtype) -> int:
    """An estimate of the Triton kernel's shared memory for one program (bytes), fitted to
    what the H100's compiler requested (``benchmarks/gpu_launch_sweep.py --calibrate``,
    BENCHMARKS.md): the K and V tiles (``tile`` keys of ``head_tile(D)`` columns, at the
    wider of the cache and query dtypes, as the dot consumes them) held twice for 32-bit
    data (FMA dots: what the compiler asked for at 2, 3 and 4 stages alike, within 256
    bytes) and for a tile inside one page (a contiguous copy the compiler double-buffers:
    bfloat16, head 256, one 128-key page asked for exactly twice), once for 16-bit data
    gathered from several pages (MMA dots: 256-key tiles at 3 stages launched, which twice
    would not), plus the q block (``bs.rows(G)`` rows), plus 1 KiB. A tile is
    ``head_tile(D * kv_heads_per_program)`` columns wide.
    """
    rows, tile, width = bs.rows(group), bs.tile(page_size), head_tile(head_size * bs.kv_heads_per_program)
    q_bytes = np.dtype(q_dtype).itemsize
    kv_bytes = max(np.dtype(kv_dtype).itemsize, q_bytes)
    copies = 2 if kv_bytes >= 4 or bs.pages_per_tile == 1 else 1
    return copies * 2 * tile * width * kv_bytes + rows * width * q_bytes + 1024


def check_block_sizes(bs: GpuBlockSizes, *, group: int, page_size: int) -> None:
    """Raises ValueError naming the field when ``bs`` cannot tile this configuration."""
    rows, tile = bs.rows(group), bs.tile(page_size)
    if bs.keys_per_tile is not None:
        k = bs.keys_per_tile
        if isinstance(k, bool) or not isinstance(k, int) or k < 16 or k & (k - 1) or k >= page_size:
            raise ValueError(
                f"block sizes: keys_per_tile={k!r} must be a power of two >= 16 below page_size={page_size}"
            )
        if bs.pages_per_tile != 1:
            raise ValueError(f"block sizes: keys_per_tile={k} needs pages_per_tile=1, not {bs.pages_per_tile}")
    for name in ("block_q", "pages_per_tile", "num_kv_splits", "num_warps", "num_stages", "kv_heads_per_program"):
        value = getattr(bs, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"block sizes: {name}={value!r} must be a positive int")
    for name in ("block_q", "pages_per_tile", "num_warps"):
        value = getattr(bs, name)
        if value & (value - 1):
            raise ValueError(f"block sizes: {name}={value} must be a power of two")
    if rows < 16:
        raise ValueError(
            f"block sizes: block_q={bs.block_q} x kv_heads_per_program={bs.kv_heads_per_program} gives {rows} "
            f"rows for a head group of {group} (each padded to a power of two); the GPU kernel needs at least 16"
        )
    if tile < 16:
        raise ValueError(
            f"block sizes: pages_per_tile={bs.pages_per_tile} x page_size={page_size} = {tile} keys "
            "per tile; the GPU kernel needs at least 16"
        )


@functools.cache
def load_tuned_table(name: str) -> dict[str, Any]:
    """The parsed ``tuned/<name>.json``; FileNotFoundError lists the tables there are."""
    path = TUNED_DIR / f"{name}.json"
    if not path.exists():
        have = sorted(p.stem for p in TUNED_DIR.glob("*.json"))
        raise FileNotFoundError(f"no tuned table {name!r} in {TUNED_DIR}; tables: {have}")
    table = json.loads(path.read_text())
    for key in ("device_kind", "source", "entries"):
        if key not in table:
            raise ValueError(f"tuned table {path.name} lacks {key!r}")
    return table


@functools.cache
def tuned_tables(prefix: str) -> tuple[str, ...]:
    """Names of the tables whose file name starts with ``prefix`` (e.g. "gpu_"), listed once per
    process as ``load_tuned_table`` reads each once (every serving step's metadata looks its
    device's table up, so no step touches the file system)."""
    return tuple(sorted(p.stem for p in TUNED_DIR.glob(f"{prefix}*.json")))


def tuned_table_for(prefix: str, device_kind: str | None) -> dict[str, Any] | None:
    """The table among ``tuned_tables(prefix)`` whose ``device_kind`` equals ``device_kind``, or None."""
    if device_kind is None:
        return None
    for name in tuned_tables(prefix):
        table = load_tuned_table(name)
        if table["device_kind"] == device_kind:
            return table
    return None


def gpu_entry_key(entry: dict[str, Any]) -> tuple:
    """A GPU table entry's values of ``GPU_MATCH_KEYS``, in their order (None where absent)."""
    return tuple(entry.get(k) for k in GPU_MATCH_KEYS)


def gpu_entry_block_sizes(entry: dict[str, Any]) -> GpuBlockSizes:
    """The block sizes of one table entry (its match keys and ``note`` aside); ValueError names bad keys."""
    known = {f.name for f in dataclasses.fields(GpuBlockSizes)}
    unknown = set(entry) - known - set(GPU_MATCH_KEYS) - {"note"}
    if unknown:
        raise ValueError(f"tuned entry {entry} has unknown keys {sorted(unknown)}; valid: {sorted(known)}")
    if entry.get("mode") not in GPU_LAUNCH_MODES:
        raise ValueError(
            f"tuned entry mode={entry.get('mode')!r} is not one of {list(GPU_LAUNCH_MODES)} "
            "(a prefill batch runs the mixed launch)"
        )
    return GpuBlockSizes(**{k: v for k, v in entry.items() if k in known})


@dataclasses.dataclass(frozen=True)
class GpuBlockChoice:
    """Block sizes and where they came from, in words (``attn-stack info`` prints it)."""

    block_sizes: GpuBlockSizes
    source: str


def gpu_block_sizes(**kwargs) -> GpuBlockSizes:
    """``gpu_block_choice(...).block_sizes``."""
    return gpu_block_choice(**kwargs).block_sizes


def fit_smem(bs: GpuBlockSizes, *, group: int, page_size: int, limit: int, **dims) -> tuple[GpuBlockSizes, list[str]]:
    """``bs`` stepped down until ``triton_smem_bytes`` fits ``limit``: half the K/V tile (fewer
    pages, then part of a page, down to 16 keys), then half the q block (down to 16 rows).
    Returns the block sizes and one line per step taken."""
    steps = []

    def size(b):
        return triton_smem_bytes(b, group=group, page_size=page_size, **dims)

    while size(bs) > limit:
        before = size(bs)
        if bs.pages_per_tile > 1 and bs.tile(page_size) > 16:
            bs = dataclasses.replace(bs, pages_per_tile=bs.pages_per_tile // 2)
        elif bs.tile(page_size) > 16 and page_size > 16:
            bs = dataclasses.replace(bs, keys_per_tile=bs.tile(page_size) // 2)
        elif bs.block_q > 1 and bs.block_q * next_pow2(group) > 16:
            bs = dataclasses.replace(bs, block_q=bs.block_q // 2)
        else:
            raise ValueError(
                f"no Triton block sizes fit {limit} bytes of shared memory for head_size={dims['head_size']}, "
                f"group={group}, page_size={page_size}, q_dtype={np.dtype(dims['q_dtype'])}, "
                f"kv_dtype={np.dtype(dims['kv_dtype'])}: {bs} needs about {before}"
            )
        steps.append(f"{before} B > {limit} B of shared memory: stepped down to {bs}")
    return bs, steps


def decode_part_block_sizes(
    launch: GpuBlockSizes, decode: GpuBlockSizes, *, group: int, page_size: int, device_kind: str | None, **dims
) -> GpuBlockSizes | None:
    """A mixed batch's decode part (its decodes in the same launch as its other rows, see
    ``pallas_triton.mixed_schedule``): ``decode`` (the bucket's decode blocks) on ``launch``'s
    warps and stages, unsplit, stepped down (``fit_smem``) to ``device_kind``'s shared memory;
    None when ``launch`` splits the KV range. What it gains on the H100: BENCHMARKS.md ("Mixed
    batches: their decodes on decode blocks in the same launch")."""
    if launch.num_kv_splits != 1:
        return None
    part = dataclasses.replace(decode, num_kv_splits=1, num_warps=launch.num_warps, num_stages=launch.num_stages)
    return fit_smem(part, group=group, page_size=page_size, limit=gpu_smem_limit(device_kind), **dims)[0]


MAX_PACKED_WIDTH = 256
"""The widest tile ``kv_heads_to_pack`` packs KV heads into (columns)."""


def kv_heads_to_pack(head_size: int, num_kv_heads: int) -> int:
    """How many adjacent KV heads a decode program reads as one tile for a head narrower than
    its power-of-two tile: the most that fit ``MAX_PACKED_WIDTH`` columns (more bytes per key
    loaded; head 80: 3, 240 of 256 columns; 96 and 112: 2). 1 for power-of-two heads, whose
    tiles have no masked columns."""
    if head_tile(head_size) == head_size:
        return 1
    return max(1, min(num_kv_heads, MAX_PACKED_WIDTH // head_size))


FMA_DOT_ROWS = 16
"""The most query rows (``GpuBlockSizes.rows``) PALLAS_GPU's builder gives a q-block of cascade
attention's prefix part where the Triton kernel's dots run on FMA units (``fma_dots``): the
rows of a decode block, whose FMA dots the plain path runs. At 64 rows a float32 prefix part
made S1 scaled to 16 x (1024 + 32) tokens 4.4x slower on an H100 (issue 49)."""


def fma_dots(q_dtype, *, query_quant: bool = False) -> bool:
    """Whether the Triton kernel's dots for ``q_dtype`` queries run on FMA units instead of
    tensor cores: float32 dots take ``Precision.HIGHEST`` (no TF32), which lowers to ``tt.dot``
    at IEEE precision, a loop of scalar FMAs over K holding each thread's operand rows in
    registers (no float32 MMA); its time grows with the rows of a q-block. 16-bit dots take
    MMA / wgmma, and so do FP8 attention's (``query_quant``: e4m3 operands) whatever ``q_dtype``."""
    return np.dtype(q_dtype) == np.float32 and not query_quant


def gpu_block_choice(
    *,
    num_reqs: int,
    pages_per_req: int,
    page_size: int,
    head_size: int,
    num_kv_heads: int,
    group: int,
    mode: str,
    q_dtype=np.float32,
    kv_dtype=None,
    device_kind: str | None = None,
    num_sms: int = H100_NUM_SMS,
) -> GpuBlockChoice:
    """Block sizes for one bucket of the GPU kernel: the tuned entry, else the heuristic,
    stepped down (``fit_smem``) until they fit the device's shared memory for these dtypes
    (``kv_dtype`` None: the cache holds ``q_dtype``).

    The heuristic packs 16 rows per q-block for decode (one token times the head group,
    padded to a power of two; a narrow head packs ``kv_heads_to_pack`` KV heads a program)
    and 64 for mixed batches, with tiles of 64 keys. A decode
    bucket whose ``num_reqs * num_kv_heads`` programs would not fill ``2 * num_sms`` splits
    the KV range (flash-decoding) as long as each split keeps at least 4 tiles; an
    unsplit decode program of one KV head gets 8 warps, every other 4 (packed heads ran
    8-10 % faster on 4 at head 80 on the H100, BENCHMARKS.md). A tuned entry may set any field,
    ``num_kv_splits`` and ``num_warps`` included.
    """
    if mode not in GPU_LAUNCH_MODES:
        raise ValueError(
            f"mode={mode!r} is not one of {list(GPU_LAUNCH_MODES)} (a prefill batch runs the mixed launch)"
        )
    q_name = np.dtype(q_dtype).name
    kv_name = np.dtype(q_dtype if kv_dtype is None else kv_dtype).name
    source = "heuristic"
    decode_only = mode == "decode"
    pack = kv_heads_to_pack(head_size, num_kv_heads) if decode_only else 1
    fields: dict[str, int] = {
        "block_q": max((16 if decode_only else 64) // (next_pow2(pack) * next_pow2(group)), 1),
        "pages_per_tile": max(64 // page_size, 1),
        "num_stages": 2,
        "kv_heads_per_program": pack,
    }
    table = tuned_table_for("gpu_", device_kind)
    key = (mode, head_size, group, page_size, q_name, kv_name)
    for entry in (table or {}).get("entries", []):
        if gpu_entry_key(entry) == key:
            gpu_entry_block_sizes(entry)  # validates the entry
            fields.update({k: v for k, v in entry.items() if k not in GPU_MATCH_KEYS and k != "note"})
            matched = ", ".join(f"{k}={v}" for k, v in zip(GPU_MATCH_KEYS, key, strict=True))
            source = f"tuned entry of {table['device_kind']!r} ({matched})"
            break
    if "num_kv_splits" not in fields:
        max_tiles = -(-pages_per_req // fields["pages_per_tile"])
        programs = num_reqs * -(-num_kv_heads // fields["kv_heads_per_program"])
        fields["num_kv_splits"] = max(1, min((2 * num_sms) // programs, max_tiles // 4)) if decode_only else 1
    if "num_warps" not in fields:  # an unsplit decode program streams a whole KV range: more loads in flight
        unsplit = decode_only and fields["num_kv_splits"] == 1
        fields["num_warps"] = 8 if unsplit and fields["kv_heads_per_program"] == 1 else 4
    bs = GpuBlockSizes(**fields)
    check_block_sizes(bs, group=group, page_size=page_size)
    limit = gpu_smem_limit(device_kind)
    bs, steps = fit_smem(
        bs, group=group, page_size=page_size, limit=limit, head_size=head_size, q_dtype=q_dtype, kv_dtype=kv_name
    )
    return GpuBlockChoice(bs, "; ".join([source, *steps]))


@dataclasses.dataclass(frozen=True)
class MgpuBlockSizes:
    """Static tiling of the Mosaic GPU prefill kernel (``pallas_mosaic_gpu``).

    block_q: query rows per compute warpgroup (a CTA's q-tile is ``2 * block_q`` tokens);
    block_kv: keys per K/V block (a multiple of the page size, or a divisor of it);
    steps_in_flight: K/V blocks in the shared-memory ring (>= 2);
    num_ctas: None launches one CTA per q-tile and query head; an int (the GPU's SM count)
    launches at most that many, each looping over one (tile, head) of each wave of that many
    (``pallas_mosaic_gpu.dealt_item``) with its K/V ring streaming on into the next one, when
    the items fill at most ``pallas_mosaic_gpu.PERSISTENT_MAX_WAVES`` waves of them
    (``persistent_ctas``).
    """

    block_q: int = 64
    block_kv: int = 128
    steps_in_flight: int = 2
    num_ctas: int | None = None

    def __post_init__(self):
        if self.block_q != 64:
            raise ValueError(f"Mosaic GPU block sizes: block_q={self.block_q} must be 64 (one wgmma row tile)")
        if self.block_kv not in (64, 128, 256):
            raise ValueError(f"Mosaic GPU block sizes: block_kv={self.block_kv} must be 64, 128 or 256")
        if not isinstance(self.steps_in_flight, int) or self.steps_in_flight < 2:
            raise ValueError(f"Mosaic GPU block sizes: steps_in_flight={self.steps_in_flight!r} must be >= 2")
        if self.num_ctas is not None and (not isinstance(self.num_ctas, int) or self.num_ctas < 1):
            raise ValueError(f"Mosaic GPU block sizes: num_ctas={self.num_ctas!r} must be None or an int >= 1")

    @property
    def tile(self) -> int:
        return 2 * self.block_q

    def smem_bytes(
        self, head_size: int, dtype, cache_dtype=None, v_head_size: int | None = None, staged: bool = False
    ) -> int:
        """Shared memory of one CTA (bytes): two q/out tiles and the K and V rings, plus 4 KiB for
        barriers and alignment (Mosaic GPU asked for 2.1-3.2 KiB over the buffers); with a
        1-byte ``cache_dtype`` (FP8 attention) also each warpgroup's e4m3 q tile and a ring of
        float16 V blocks. ``v_head_size`` (V narrower than q/k: MLA) adds the output tiles the
        q tiles then cannot hold; ``staged`` the untiled q/out tiles of a token count that is
        not a multiple of 8."""
        itemsize = np.dtype(dtype).itemsize
        cache_itemsize = np.dtype(cache_dtype or dtype).itemsize
        dv = v_head_size or head_size
        ring = self.steps_in_flight * self.block_kv * (head_size + dv) * cache_itemsize
        total = 2 * self.block_q * head_size * itemsize + ring + 4096
        if dv != head_size:
            total += 2 * self.block_q * dv * itemsize
        if staged:
            total += 2 * self.block_q * head_size * itemsize
        if cache_itemsize == 1:
            total += 2 * self.block_q * head_size + self.steps_in_flight * self.block_kv * head_size * 2
        return total


MOSAIC_GPU_SMEM_BYTES = GPU_SMEM_BYTES["H100"]
"""Hopper's budget: the Mosaic GPU kernel runs on Hopper only."""

MGPU_MATCH_KEYS = ("head_size",)
"""What an ``mgpu_entries`` item of a GPU table matches on."""


def mgpu_block_sizes(*, head_size: int, device_kind: str | None = None) -> MgpuBlockSizes:
    """The Mosaic GPU prefill tiling: the device table's ``mgpu_entries`` item for this head
    size, else 64 rows per warpgroup, 128-key blocks (64 past head 128, whose ring of 128 would
    not fit Hopper's shared memory) and a 2-deep ring."""
    table = tuned_table_for("gpu_", device_kind)
    for entry in (table or {}).get("mgpu_entries", []):
        if entry.get("head_size") == head_size:
            return mgpu_entry_block_sizes(entry)
    return MgpuBlockSizes(block_kv=64 if head_size > 128 else 128)


def mgpu_entry_block_sizes(entry: dict[str, Any]) -> MgpuBlockSizes:
    """The block sizes of one ``mgpu_entries`` item; ValueError names unknown keys or bad values."""
    known = {f.name for f in dataclasses.fields(MgpuBlockSizes)}
    unknown = set(entry) - known - set(MGPU_MATCH_KEYS) - {"note"}
    if unknown:
        raise ValueError(f"tuned Mosaic GPU entry {entry} has unknown keys {sorted(unknown)}; valid: {sorted(known)}")
    return MgpuBlockSizes(**{k: v for k, v in entry.items() if k in known})


MGPU_DEVICE_KINDS = ("H100", "H200", "H800", "H20", "GH200")
"""Hopper parts (``jax.Device.device_kind`` contains one of these): where the Mosaic GPU
prefill kernel (``pallas_mosaic_gpu``: TMA and warpgroup MMA, sm_90a) is compiled."""


def mgpu_prefill_available(device_kind: str | None) -> bool:
    """Whether the metadata builder schedules the Mosaic GPU prefill kernel on this device."""
    return device_kind is not None and any(f" {k} " in f" {device_kind} " for k in MGPU_DEVICE_KINDS)


# --------------------------------------------------------------------------------------
# TPU (pallas_mosaic_tpu.py)
# --------------------------------------------------------------------------------------

TPU_MATCH_KEYS = ("q_dtype", "kv_dtype", "head_size", "page_size", "max_num_tokens", "max_model_len")
"""What a TPU table entry matches on; the two lengths are rounded up to powers of two first."""


@dataclasses.dataclass(frozen=True)
class TpuBlockSizes:
    """Static tiling of one TPU launch.

    q_tokens_per_block: query tokens per q-block; ``q_tokens_per_block * G`` matmul rows,
    a multiple of the sublane tile (8 rows for float32 queries, 16 for bf16 / f16).
    kv_pages_per_block: pages per KV block (one DMA each per KV head block, double-buffered).
    kv_heads_per_block: KV heads per program; divides the (per-shard) number of KV heads,
    and its ``kv_heads_per_block * G`` query heads are a multiple of 8 or all of them (the
    q block's second-minor dim). None: the fewest that tile (``min_kv_heads_per_block``).
    """

    q_tokens_per_block: int
    kv_pages_per_block: int
    kv_heads_per_block: int | None = None


def min_kv_heads_per_block(group: int, num_kv_heads: int) -> int:
    """The fewest KV heads per program whose ``G`` query heads each fill whole 8-row tiles
    (or all the KV heads, when no divisor does)."""
    for d in range(1, num_kv_heads + 1):
        if num_kv_heads % d == 0 and (d * group) % 8 == 0:
            return d
    return num_kv_heads


def _sublane_rows(q_dtype) -> int:
    return 8 if np.dtype(q_dtype).itemsize == 4 else 16


def check_tpu_block_sizes(
    bs: TpuBlockSizes, *, group: int, num_kv_heads: int, pages_per_req: int | None = None, q_dtype=np.float32
) -> None:
    """Raises ValueError naming the field when ``bs`` cannot tile this configuration."""
    for name in ("q_tokens_per_block", "kv_pages_per_block", "kv_heads_per_block"):
        value = getattr(bs, name)
        if value is None and name == "kv_heads_per_block":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"TPU block sizes: {name}={value!r} must be a positive int")
    tile = _sublane_rows(q_dtype)
    rows = bs.q_tokens_per_block * group
    if rows % tile:
        raise ValueError(
            f"TPU block sizes: q_tokens_per_block={bs.q_tokens_per_block} x group={group} = {rows} rows "
            f"must be a multiple of {tile} (the sublane tile of {np.dtype(q_dtype)} queries)"
        )
    hb = bs.kv_heads_per_block
    if hb is not None and num_kv_heads % hb:
        raise ValueError(f"TPU block sizes: kv_heads_per_block={hb} must divide num_kv_heads={num_kv_heads}")
    if hb is not None and hb != num_kv_heads and (hb * group) % 8:
        raise ValueError(
            f"TPU block sizes: kv_heads_per_block={hb} x group={group} = {hb * group} query heads per block "
            f"must be a multiple of 8 or all {num_kv_heads * group} query heads"
        )
    if pages_per_req is not None and bs.kv_pages_per_block > max(pages_per_req, 1):
        raise ValueError(
            f"TPU block sizes: kv_pages_per_block={bs.kv_pages_per_block} exceeds the bucket's "
            f"pages_per_req={pages_per_req}"
        )


def tpu_entry_block_sizes(entry: dict[str, Any]) -> TpuBlockSizes:
    """The block sizes of one TPU table entry (its ``match`` keys removed)."""
    fields = {k: v for k, v in entry.items() if k not in TPU_MATCH_KEYS}
    try:
        return TpuBlockSizes(**fields)
    except TypeError as e:
        raise ValueError(f"tuned entry {entry} has unknown keys: {e}") from None


def tpu_block_sizes(
    *,
    q_dtype,
    kv_dtype,
    group: int,
    head_size: int,
    page_size: int,
    num_kv_heads: int,
    num_tokens: int,
    pages_per_req: int,
    decode_only: bool = False,
    max_query_len: int | None = None,
    device_kind: str | None = None,
) -> TpuBlockSizes:
    """Block sizes for one bucket of the TPU kernel: the tuned entry, else the heuristic.

    The heuristic takes the fewest query tokens whose ``tokens * G`` rows fill the sublane
    tile for decode-only buckets (each decode is its own request, so more tokens per block
    only add masked rows), 256 tokens when a request brings 1024 or more new tokens
    (``max_query_len``, default ``num_tokens``: long prefills re-read less KV) and 128
    otherwise (decodes in a mixed q-block run on their own rows, so a large block costs
    them nothing), KV blocks of 256 keys, the fewest KV heads per program that tile the
    q block (``min_kv_heads_per_block``); benchmarks/tpu_cost_model.py
    shows the trade-off on DESIGN.md's workloads. Every value is clamped to the bucket
    (tokens, pages per request).
    """
    tile = _sublane_rows(q_dtype)
    min_tokens = tile // math.gcd(tile, group)
    long_prefill = (num_tokens if max_query_len is None else max_query_len) >= 1024
    bq = min_tokens if decode_only else max(min_tokens, 256 if long_prefill else 128)
    ppb = max(256 // page_size, 1)
    table = tuned_table_for("tpu_", device_kind)
    key = (
        np.dtype(q_dtype).name, np.dtype(kv_dtype).name, head_size, page_size,
        next_pow2(num_tokens), next_pow2(page_size * pages_per_req),
    )  # fmt: skip
    for entry in (table or {}).get("entries", []):
        if tuple(entry.get(k) for k in TPU_MATCH_KEYS) == key:
            tuned = tpu_entry_block_sizes(entry)
            ppb = tuned.kv_pages_per_block
            if not decode_only:  # a tuned count that does not tile this group rounds up
                bq = -(-tuned.q_tokens_per_block // min_tokens) * min_tokens
            break
    bq = min(bq, -(-num_tokens // min_tokens) * min_tokens)  # no block larger than the bucket needs
    bq = -(-bq // min_tokens) * min_tokens
    bs = TpuBlockSizes(
        q_tokens_per_block=bq,
        kv_pages_per_block=min(ppb, max(pages_per_req, 1)),
        kv_heads_per_block=min_kv_heads_per_block(group, num_kv_heads),
    )
    check_tpu_block_sizes(bs, group=group, num_kv_heads=num_kv_heads, pages_per_req=pages_per_req, q_dtype=q_dtype)
    return bs
