"""Reads oscar's INT2 pages (docs/format.md, format version 1) in Python with numpy alone.

An engine written in Python that keeps its KV cache in oscar's pools (vLLM, SGLang, ...) can
vendor this file to look inside a page: the 2-bit codes, the fp16 scale and offset of every
group, and the rows they stand for, bit for bit what oscar's CPU reference and kernels read
(x = fma(code, scale, offset) in float32). Useful for checking an integration, for tests and
for offline analysis; not a fast path.

    block = k_int2_pool[page, head]                    # numpy uint8, int2_block_bytes(...) long
    rows = dequantize_int2_block(block, head_dim=128, page_size=16)   # float32 [16, 128]
    keys = unrotate(rows, plan.k_rotation[layer])      # back to the model's basis: rows @ R_K.T

The rows are in the rotated basis the cache stores (k' = k @ R_K, v' = v @ R_V), as the
kernels read them; `unrotate` takes them back. A row whose input had a NaN or Inf reads back
as NaN (its groups store NaN metadata), as in oscar.
"""

import numpy as np

INT2_FORMAT_VERSION = "1"  # oscar::kInt2FormatVersion: the layout this file reads
SUPPORTED_HEAD_DIMS = (64, 128, 256)


class PageError(ValueError):
    """A block or shape that does not match the INT2 format, with the reason."""


def _check_shape(head_dim: int, page_size: int, quant_group: int) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise PageError(f"head_dim {head_dim} is not supported (supported: 64, 128, 256)")
    if quant_group < 32 or quant_group > head_dim or quant_group & (quant_group - 1):
        raise PageError(f"quant_group {quant_group} is not supported for head_dim {head_dim} "
                        "(a power of two from 32 up to head_dim)")
    if page_size < 8 or page_size > 256 or page_size & (page_size - 1):
        raise PageError(f"page_size {page_size} is not supported (a power of two from 8 to 256)")


def int2_block_bytes(head_dim: int, page_size: int, quant_group: int | None = None) -> int:
    """Bytes of one (page, kv head) block: codes [page_size][head_dim / 4], then metadata
    [page_size][head_dim / quant_group] of {fp16 scale, fp16 offset} (oscar::Int2Layout)."""
    g = head_dim if quant_group is None else quant_group
    _check_shape(head_dim, page_size, g)
    return page_size * head_dim // 4 + page_size * (head_dim // g) * 4


def unpack_codes(packed: np.ndarray, head_dim: int, quant_group: int | None = None) -> np.ndarray:
    """The 2-bit codes (uint8 0..3) of rows packed four per byte: [..., head_dim / 4] ->
    [..., head_dim]. Within each group of G elements, byte j of the group's G/4 bytes holds the
    group's elements j, G/4 + j, G/2 + j, 3G/4 + j in bits 0-1, 2-3, 4-5, 6-7."""
    g = head_dim if quant_group is None else quant_group
    packed = np.asarray(packed, dtype=np.uint8)
    if packed.shape[-1] != head_dim // 4:
        raise PageError(f"packed rows have {packed.shape[-1]} bytes, expected head_dim / 4 = {head_dim // 4}")
    groups = packed.reshape(packed.shape[:-1] + (head_dim // g, g // 4))
    # [..., group, quarter, j]: quarter k of a group is bits 2k..2k+1 of its bytes.
    fields = np.stack([(groups >> (2 * k)) & 3 for k in range(4)], axis=-2)
    return fields.reshape(packed.shape[:-1] + (head_dim,)).astype(np.uint8)


def read_int2_block(block: np.ndarray, head_dim: int, page_size: int, quant_group: int | None = None):
    """The codes (uint8 [page_size, head_dim]), scales and offsets (float16 [page_size,
    head_dim / quant_group]) of one INT2 block, checked against the format's size."""
    g = head_dim if quant_group is None else quant_group
    expected = int2_block_bytes(head_dim, page_size, g)
    block = np.ascontiguousarray(np.asarray(block, dtype=np.uint8).reshape(-1))
    if block.size != expected:
        raise PageError(f"an INT2 block of head_dim {head_dim}, page_size {page_size} and quant_group {g} "
                        f"has {expected} bytes; got {block.size}")
    code_bytes = page_size * head_dim // 4
    codes = unpack_codes(block[:code_bytes].reshape(page_size, head_dim // 4), head_dim, g)
    meta = block[code_bytes:].view("<f2").reshape(page_size, head_dim // g, 2)
    return codes, meta[..., 0].copy(), meta[..., 1].copy()


def dequantize_int2_block(block: np.ndarray, head_dim: int, page_size: int, quant_group: int | None = None,
                          rows: int | None = None) -> np.ndarray:
    """The float32 rows [rows or page_size, head_dim] of one INT2 block: fma(code, scale,
    offset) per element, rounded once to float32 as oscar's dequantize_code does (the product
    and sum are exact in float64 for fp16 metadata and codes 0..3, so one rounding matches the
    fused multiply-add). `rows` keeps only a page's first rows (a request's last page)."""
    g = head_dim if quant_group is None else quant_group
    codes, scale, offset = read_int2_block(block, head_dim, page_size, g)
    per_element = np.repeat(np.arange(head_dim // g), g)  # each element's group
    x = codes.astype(np.float64) * scale.astype(np.float64)[:, per_element] + offset.astype(np.float64)[:, per_element]
    out = x.astype(np.float32)
    return out if rows is None else out[:rows]


def unrotate(rows: np.ndarray, rotation: np.ndarray) -> np.ndarray:
    """Rows stored in the rotated basis (x' = x @ R) back in the model's: x' @ R.T, in float64
    then float32 (R orthogonal, from oscar_plan.load_plan)."""
    rows = np.asarray(rows)
    r = np.asarray(rotation, dtype=np.float64)
    if r.shape != (rows.shape[-1], rows.shape[-1]):
        raise PageError(f"rotation of shape {r.shape} for rows of {rows.shape[-1]} channels")
    return (rows.astype(np.float64) @ r.T).astype(np.float32)
