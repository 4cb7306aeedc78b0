"""Writes the TPU block-size tables ``attn_jax/ops/ragged_paged_attention/tuned/tpu_*.json``.

No TPU is lent to this project, so the numbers are not measured here: they are JAX's
public auto-tuned table for its own TPU ragged paged attention kernel
(``jax.experimental.pallas.ops.tpu.ragged_paged_attention.tuned_block_sizes``, jax
0.11.2), the entries for bf16 queries and cache, head_dim 128, 4 query heads and one KV
head per block: the shape of one program of our kernel for a group of 4 (Llama-3's 32 / 8).
Their (num_kv_pages_per_block, num_queries_per_block) become our (kv_pages_per_block,
q_tokens_per_block); entries whose max_model_len is not a power of two are skipped (our
lookup rounds lengths up to powers of two). v7x has no public table in jax 0.11.2: its
file repeats the v6e entries and says so. Re-run on a TPU with a tuning sweep to replace
them.

Run: .venv/bin/python benchmarks/tpu_block_tables.py [--write | --out DIR]
(prints the entry counts; ``--write`` rewrites the committed tables, ``--out DIR`` writes them to DIR)
"""

import argparse
import json
import pathlib

from jax.experimental.pallas.ops.tpu.ragged_paged_attention.tuned_block_sizes import TUNED_BLOCK_SIZES

OUT = pathlib.Path(__file__).resolve().parents[1] / "attn_jax" / "ops" / "ragged_paged_attention" / "tuned"
SOURCE = (
    "jax 0.11.2 jax/experimental/pallas/ops/tpu/ragged_paged_attention/tuned_block_sizes.py "
    "TUNED_BLOCK_SIZES[{jax_name!r}], keys (bfloat16, bfloat16, 4 q heads, 1 kv head, head_dim 128); "
    "converted by benchmarks/tpu_block_tables.py; not measured by this project"
)
TABLES = {
    # file name: (device_kind as jax.Device.device_kind reports it, JAX table name, note)
    "tpu_v5e": ("TPU v5 lite", "TPU v5", ""),
    "tpu_v6e": ("TPU v6 lite", "TPU v6", ""),
    "tpu_v7x": ("TPU7x", "TPU v6", "; no public v7x table in jax 0.11.2: the v6e entries, not tuned for v7x"),
}


def entries(jax_name: str) -> list[dict]:
    out = []
    for key, (pages, tokens) in sorted(TUNED_BLOCK_SIZES[jax_name].items()):
        q_dtype, kv_dtype, q_heads, kv_heads, head_dim, page_size, max_tokens, max_len = key
        if (q_heads, kv_heads) != (4, 1) or max_len & (max_len - 1):
            continue
        out.append(dict(
            q_dtype=q_dtype, kv_dtype=kv_dtype, head_size=head_dim, page_size=page_size,
            max_num_tokens=max_tokens, max_model_len=max_len,
            kv_pages_per_block=pages, q_tokens_per_block=tokens,
        ))  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--write", action="store_true", help=f"rewrite the committed tables in {OUT}")
    where.add_argument("--out", type=pathlib.Path, default=None, metavar="DIR", help="write the tables to DIR")
    args = parser.parse_args()
    folder = args.out if args.out is not None else OUT if args.write else None
    for name, (device_kind, jax_name, note) in TABLES.items():
        table = dict(device_kind=device_kind, source=SOURCE.format(jax_name=jax_name) + note, entries=entries(jax_name))
        print(f"{name}.json: {len(table['entries'])} entries")
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{name}.json").write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote the tables to {folder}" if folder is not None else "(tables not written: pass --write or --out DIR)")


if __name__ == "__main__":
    main()
