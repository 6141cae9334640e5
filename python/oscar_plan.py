"""Reads an oscar plan file (docs/fitting.md, section 4) in Python with numpy alone.

A plan is a safetensors file: per layer R_K and R_V (float32 [head_dim, head_dim], row-major,
k' = k @ R_K, q' = q @ R_K, v' = v @ R_V, o = o' @ R_V.T) and the clip ratios rho_K, rho_V per
layer, with the model's shape in the metadata. An engine written in Python (vLLM, SGLang, ...)
can vendor this file to get the rotations it folds into its weights or passes to oscar's
kernels, and the clip ranks the kernels take, computed exactly as oscar::clip_rank does.

    plan = load_plan("plan.safetensors")
    plan.k_rotation[layer]          # numpy float32 [head_dim, head_dim]
    plan.k_clip_rank(layer)         # int, -1 for no clipping

Checks what oscar::io::load_plan checks (the safetensors structure, format, versions, the
required metadata and its ranges, tensor names, dtypes and shapes, the content checksum where
the file has one, finite entries, orthogonal rotations, ratios in (0, 1]) and raises PlanError
naming the problem. `python3 oscar_plan.py PLAN` prints a
summary, or the error and exit status 2.
"""

import json
import math
import re
import struct
import sys
import zlib
from dataclasses import dataclass

import numpy as np

FORMAT = "oscar-plan"
FORMAT_VERSION = "1"
INT2_FORMAT_VERSION = "1"  # oscar::kInt2FormatVersion: the code order the rotations were fitted for
ORTHOGONALITY_TOLERANCE = 1e-4  # max |R R^T - I|, as oscar::io::load_plan
CHECKSUM_KEY = "content_crc32"  # absent from plans written before it existed
# The metadata the checksum covers, in order (oscar::io::detail::kChecksummedKeys).
CHECKSUMMED_KEYS = ("format", "format_version", "int2_format_version", "method", "clip_method", "head_dim",
                    "num_layers", "num_qo_heads", "num_kv_heads", "quant_group_size", "sink_tokens",
                    "recent_tokens", "calibration_tokens")


class PlanError(ValueError):
    """A plan file that cannot be used, with the reason."""


def clip_rank(rho: float, head_dim: int) -> int:
    """The rank of the clip threshold among a row's sorted magnitudes, or -1 for no clipping
    (oscar::clip_rank: min(floor(rho * d), d - 1) in double precision)."""
    rho = float(np.float32(rho))  # the ratio as the file stores it, widened exactly
    if not (0.0 < rho < 1.0):
        return -1
    return min(int(math.floor(rho * head_dim)), head_dim - 1)


@dataclass
class Plan:
    metadata: dict
    k_rotation: np.ndarray  # float32 [num_layers, head_dim, head_dim]
    v_rotation: np.ndarray
    k_clip_ratios: np.ndarray  # float32 [num_layers]
    v_clip_ratios: np.ndarray

    @property
    def num_layers(self) -> int:
        return int(self.metadata["num_layers"])

    @property
    def head_dim(self) -> int:
        return int(self.metadata["head_dim"])

    def k_clip_rank(self, layer: int) -> int:
        return clip_rank(self.k_clip_ratios[layer], self.head_dim)

    def v_clip_rank(self, layer: int) -> int:
        return clip_rank(self.v_clip_ratios[layer], self.head_dim)


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _read_tensors(path: str, data: bytes):
    """The header's tensors (name -> (dtype, shape, begin, end)), its metadata and the data
    buffer, with the structure oscar::io::SafetensorsFile checks: every entry well formed, its
    extent the size its dtype and shape need, and the tensors tiling the buffer."""
    if len(data) < 8:
        raise PlanError(f"{path}: truncated (no header length)")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        raise PlanError(f"{path}: truncated (header of {header_len} bytes, file of {len(data)})")
    try:
        header = json.loads(data[8:8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else e
        raise PlanError(f"{path}: corrupted header ({reason})") from None
    if not isinstance(header, dict):
        raise PlanError(f"{path}: corrupted header (not a JSON object)")
    metadata = header.pop("__metadata__", {})
    # safetensors metadata maps strings to strings (oscar::io::SafetensorsFile refuses others).
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise PlanError(f"{path}: corrupted header (__metadata__ values must be strings)")
    body = data[8 + header_len:]
    tensors = {}
    for name, info in header.items():
        where = f"{path}: tensor '{name}'"
        if not isinstance(info, dict):
            raise PlanError(f"{where}: entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _DTYPE_BYTES:
            raise PlanError(f"{where}: missing or unknown dtype {dtype!r}")
        # bool is an int in Python; JSON true is no dimension.
        if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                  for n in shape):
            raise PlanError(f"{where}: shape must be a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2 or
                not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)):
            raise PlanError(f"{where}: data_offsets must be two non-negative integers")
        begin, end = offsets
        if not begin <= end <= len(body) or end - begin != _DTYPE_BYTES[dtype] * math.prod(shape):
            raise PlanError(f"{where} lies outside the file or has the wrong size")
        tensors[name] = (dtype, tuple(shape), begin, end)
    covered = 0
    for name, (_, _, begin, end) in sorted(tensors.items(), key=lambda t: (t[1][2], t[1][3])):
        if begin != covered:
            raise PlanError(f"{path}: tensor '{name}' starts at byte {begin} of the data buffer, expected {covered} "
                            "(overlapping or non-contiguous tensors)")
        covered = end
    if covered != len(body):
        raise PlanError(f"{path}: {len(body) - covered} bytes after the last tensor (corrupted header or trailing "
                        "garbage)")
    return tensors, metadata, body


def _tensor(path: str, tensors: dict, body: bytes, name: str, shape: tuple) -> np.ndarray:
    if name not in tensors:
        raise PlanError(f"{path}: tensor '{name}' is missing")
    dtype, stored_shape, begin, end = tensors[name]
    if dtype != "F32":
        raise PlanError(f"{path}: tensor '{name}' has dtype {dtype}, expected F32")
    if stored_shape != shape:
        raise PlanError(f"{path}: tensor '{name}' has shape {list(stored_shape)}, expected {list(shape)}")
    return np.frombuffer(body[begin:end], dtype="<f4").reshape(shape).astype(np.float32)


_INT32_MAX = 2**31 - 1


def _metadata_int(path: str, metadata: dict, key: str, lo: int, hi: int = _INT32_MAX) -> int:
    """An integer as oscar::io::detail::parse_int reads it: optional '-', then digits only."""
    if key not in metadata:
        raise PlanError(f"{path}: metadata key '{key}' is missing")
    text = metadata[key]
    if not re.fullmatch(r"-?[0-9]+", text):
        raise PlanError(f"{path}: metadata '{key}' = '{text}' is not an integer")
    value = int(text)
    if not lo <= value <= hi:
        raise PlanError(f"{path}: metadata '{key}' = {text} outside [{lo}, {hi}]")
    return value


def _metadata_str(path: str, metadata: dict, key: str) -> str:
    if key not in metadata:
        raise PlanError(f"{path}: metadata key '{key}' is missing")
    return metadata[key]


def _finite(path: str, name: str, values: np.ndarray) -> np.ndarray:
    if not np.all(np.isfinite(values)):
        raise PlanError(f"{path}: tensor '{name}' has a non-finite entry")
    return values


def load_plan(path: str) -> Plan:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise PlanError(f"{path}: cannot be read ({e.strerror})") from None
    tensors, metadata, body = _read_tensors(path, data)
    if metadata.get("format") != FORMAT:
        raise PlanError(f"{path}: not an oscar plan (format '{metadata.get('format')}')")
    if _metadata_int(path, metadata, "format_version", 0) != int(FORMAT_VERSION):
        raise PlanError(f"{path}: plan format_version {metadata.get('format_version')} is not supported "
                        f"(this reader knows {FORMAT_VERSION})")
    if _metadata_int(path, metadata, "int2_format_version", 0) != int(INT2_FORMAT_VERSION):
        raise PlanError(f"{path}: fitted for INT2 format version {metadata.get('int2_format_version')}, "
                        f"this reader knows {INT2_FORMAT_VERSION}")
    # The keys and ranges oscar::io::load_plan requires, in its order.
    d = _metadata_int(path, metadata, "head_dim", 1)
    layers = _metadata_int(path, metadata, "num_layers", 1)
    qo_heads = _metadata_int(path, metadata, "num_qo_heads", 1)
    kv_heads = _metadata_int(path, metadata, "num_kv_heads", 1)
    group = _metadata_int(path, metadata, "quant_group_size", 0)
    for key in ("sink_tokens", "recent_tokens"):
        _metadata_int(path, metadata, key, 0)
    _metadata_int(path, metadata, "calibration_tokens", 0, 2**63 - 1)
    for key in ("method", "clip_method", "model_name"):
        _metadata_str(path, metadata, key)
    if d not in (64, 128, 256):
        raise PlanError(f"{path}: head_dim {d} is not supported (64, 128, 256)")
    # Bounded before anything is built from it: 2 d x d tensors per layer must exist.
    if layers > len(tensors):
        raise PlanError(f"{path}: num_layers {layers} but only {len(tensors)} tensors")
    if group != 0 and not (group >= 32 and group & (group - 1) == 0 and group <= d):
        raise PlanError(f"{path}: quant_group_size {group} is not supported for head_dim {d}")
    if qo_heads % kv_heads != 0:
        raise PlanError(f"{path}: num_qo_heads {qo_heads} is not a multiple of num_kv_heads {kv_heads}")
    expected = {f"layers.{l}.{t}_rotation" for l in range(layers) for t in "kv"} | {"k_clip_ratios", "v_clip_ratios"}
    unexpected = sorted(set(tensors) - expected)
    if unexpected:
        raise PlanError(f"{path}: unexpected tensor '{unexpected[0]}'")
    # Every tensor's name, dtype, shape and extent first, then the checksum, then the values:
    # a corrupted file is named as one (the order of oscar::io::load_plan).
    names = [f"layers.{l}.{t}_rotation" for l in range(layers) for t in "kv"] + ["k_clip_ratios", "v_clip_ratios"]
    values = {name: _tensor(path, tensors, body, name, (layers,) if name.endswith("ratios") else (d, d))
              for name in names}
    _check_content(path, tensors, metadata, body, names)
    for key in ("method", "clip_method"):
        if not all(0x20 <= ord(ch) <= 0x7e for ch in metadata[key]):
            raise PlanError(f"{path}: {key} must be printable ASCII")
    rotations = {}
    for t in "kv":
        mats = []
        for l in range(layers):
            name = f"layers.{l}.{t}_rotation"
            r = _finite(path, name, values[name])
            error = np.abs(r.astype(np.float64) @ r.T.astype(np.float64) - np.eye(d)).max()
            if error > ORTHOGONALITY_TOLERANCE:
                raise PlanError(f"{path}: {name} is not orthogonal (max |R R^T - I| = {error:.3g})")
            mats.append(r)
        rotations[t] = np.stack(mats)
    ratios = {}
    for t in "kv":
        rho = _finite(path, f"{t}_clip_ratios", values[f"{t}_clip_ratios"])
        if np.any(rho <= 0) or np.any(rho > 1):
            raise PlanError(f"{path}: {t}_clip_ratios must lie in (0, 1]")
        ratios[t] = rho
    return Plan(metadata, rotations["k"], rotations["v"], ratios["k"], ratios["v"])


def _check_content(path: str, tensors: dict, metadata: dict, body: bytes, names: list):
    """The CRC-32 of "key=value\\n" for each checksummed key, then of the bytes of the tensors
    `names` in that order, against the file's content_crc32
    (oscar::io::detail::plan_content_crc32)."""
    stored = metadata.get(CHECKSUM_KEY)
    if stored is None:
        return
    crc = 0
    for key in CHECKSUMMED_KEYS:
        try:
            line = f"{key}={metadata.get(key, '')}\n".encode()
        except UnicodeEncodeError:  # a lone surrogate escape in the JSON
            raise PlanError(f"{path}: corrupted header (metadata '{key}' is not valid UTF-8)") from None
        crc = zlib.crc32(line, crc)
    for name in names:
        _, _, begin, end = tensors[name]
        crc = zlib.crc32(body[begin:end], crc)
    computed = f"{crc:08x}"
    if stored != computed:
        raise PlanError(f"{path}: content checksum mismatch ({CHECKSUM_KEY} {stored}, computed {computed}): "
                        "the file is corrupted")


def main(argv) -> int:
    if len(argv) != 2:
        print("usage: oscar_plan.py PLAN.safetensors", file=sys.stderr)
        return 2
    try:
        plan = load_plan(argv[1])
    except PlanError as e:
        print(f"oscar_plan: {e}", file=sys.stderr)
        return 2
    m = plan.metadata
    print(f"method={m.get('method')} clip_method={m.get('clip_method')} num_layers={plan.num_layers} "
          f"head_dim={plan.head_dim} num_qo_heads={m.get('num_qo_heads')} num_kv_heads={m.get('num_kv_heads')} "
          f"model_name={m.get('model_name')}")
    for l in range(plan.num_layers):
        print(f"layer {l}: rho_k={plan.k_clip_ratios[l]:.4f} rank_k={plan.k_clip_rank(l)} "
              f"rho_v={plan.v_clip_ratios[l]:.4f} rank_v={plan.v_clip_rank(l)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
