#!/usr/bin/env python3
"""Turns one device run of the decode benchmarks into the table and plot of docs/benchmarks.md.

    bench_attention_gpu > bench.txt
    python3 bench/sdpa_baseline.py > sdpa.txt
    python3 bench/attention_report.py bench.txt sdpa.txt docs/img/attention_decode.png

Prints a markdown table (time, bytes the kernel must move, GB/s, % of the copy bandwidth of the
same run, speedup over PyTorch SDPA and over our BF16 decode) and writes a bar plot of the
speedups. Only the Python standard library and matplotlib (Debian python3-matplotlib)."""
import json
import re
import sys


UNITS = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9}


def load_bench(path):
    """Google Benchmark's console output (it survives a run cut short, unlike its JSON)."""
    rows = {}
    line_re = re.compile(r"^(\S+)/manual_time\s+([0-9.]+) us\s.*?GB/s=([0-9.]+)([kMG]?)/s.*?bytes=([0-9.]+)([kMG]?)")
    with open(path) as f:
        for line in f:
            m = line_re.match(line)
            if m:
                rows[m.group(1)] = {"real_time": float(m.group(2)),
                                    "GB/s": float(m.group(3)) * UNITS[m.group(4)],
                                    "bytes": float(m.group(5)) * UNITS[m.group(6)]}
    return rows


def load_sdpa(path):
    """sdpa_baseline.py's output: the device on its first line ("torch 2.x, NVIDIA H200"), then a
    line per shape. Returns ({shape: us}, device name or None)."""
    sdpa, device = {}, None
    pattern = re.compile(r"^sdpa/(\S+) ([0-9.]+) us")
    with open(path) as f:
        for line in f:
            m = pattern.match(line)
            if m:
                sdpa[m.group(1)] = float(m.group(2))
            elif line.startswith("torch ") and ", " in line:
                device = line.split(", ", 1)[1].strip()
    return sdpa, device


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    bench = load_bench(sys.argv[1])
    sdpa, device = load_sdpa(sys.argv[2])
    print(f"device: {device or 'not named in the SDPA output'}")
    copy = bench["copy"]["GB/s"] if "copy" in bench else 0.0
    print(f"copy bandwidth in the same run: {copy:.0f} GB/s\n")
    print("| shape | INT2 | bytes | GB/s | % copy | BF16 (ours) | SDPA | vs SDPA | vs BF16 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    labels, vs_sdpa, vs_bf16 = [], [], []
    for name, row in bench.items():
        if not name.startswith("int2/") or not name.endswith("page16"):
            continue
        shape = name[len("int2/"):-len("/page16")]
        us = row["real_time"]
        gbps = row["GB/s"]
        bf16 = bench.get("bf16/" + shape + "/page16")
        bf16_us = bf16["real_time"] if bf16 else float("nan")
        sdpa_us = sdpa.get(shape, float("nan"))
        pct = 100.0 * gbps / copy if copy else float("nan")
        print(f"| {shape} | {us:.1f} us | {row['bytes'] / 1e6:.1f} MB | {gbps:.0f} | {pct:.0f} % | "
              f"{bf16_us:.1f} us | {sdpa_us:.1f} us | {sdpa_us / us:.2f}x | {bf16_us / us:.2f}x |")
        labels.append(shape.replace("_", " ").replace("/", "\n"))
        vs_sdpa.append(sdpa_us / us)
        vs_bf16.append(bf16_us / us)
    print()
    for name, row in bench.items():
        if name.startswith("extend/") or (name.startswith("int2/") and not name.endswith("page16")):
            gbps = row["GB/s"]
            line = (f"- {name}: {row['real_time']:.1f} us, {row['bytes'] / 1e6:.1f} MB, {gbps:.0f} GB/s "
                    f"({100.0 * gbps / copy if copy else float('nan'):.0f} % of copy)")
            if name.startswith("extend/"):
                # The extend target is stated against reading the prefix: at copy bandwidth, and
                # (what a decode step over the same prefix costs) our decode of it.
                read_us = row["bytes"] / (copy * 1e3) if copy else float("nan")
                decode = bench.get("int2/" + name[len("extend/"):].rsplit("/", 1)[0] + "/page16")
                line += f"; {row['real_time'] / read_us:.1f}x the prefix read at copy bandwidth"
                if decode:
                    line += f", {row['real_time'] / decode['real_time']:.2f}x our decode of it"
                sdpa_us = sdpa.get(name)  # sdpa_baseline.py's BF16 extend of the same shape
                if sdpa_us:
                    line += f"; vs SDPA on BF16 ({sdpa_us:.1f} us): {sdpa_us / row['real_time']:.2f}x"
                # The same shape with single and with paired column tiles forced (the A/B of
                # AttentionPlanOptions::paired_max_chunks_per_tile), where the run has them.
                shape = name[len("extend/"):]
                forced = [(kind, bench.get(f"extend_{kind}/{shape}")) for kind in ("single", "paired")]
                if all(r for _, r in forced):
                    line += "; " + ", ".join(f"{kind} tiles {r['real_time']:.1f} us" for kind, r in forced)
            print(line)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.2))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], vs_sdpa, 0.4, label="INT2 vs PyTorch SDPA (BF16)")
    ax.bar([i + 0.2 for i in x], vs_bf16, 0.4, label="INT2 vs our BF16 decode")
    ax.axhline(6.0, color="k", linestyle="--", linewidth=1, label="target: 6x SDPA")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("speedup (time ratio)")
    # The device comes from the run (SDPA's line), not from this script: the same plot is made
    # on every device the benchmarks run on.
    name = (device or "an unnamed device").removeprefix("NVIDIA ")
    ax.set_title(f"oscar INT2 decode on the {name} (copy bandwidth {copy:.0f} GB/s, cold L2)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[3], dpi=120)


if __name__ == "__main__":
    main()
