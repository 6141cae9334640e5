#!/usr/bin/env python3
"""PyTorch scaled_dot_product_attention (BF16, default backend) on the shapes of
bench_attention_gpu, cold L2, CUDA events, median of many runs: the baseline the INT2 decode
kernel is compared with. Run on the GPU machine in the same session:
    python3 bench/sdpa_baseline.py
Prints one line per shape: name, median microseconds, GB/s over the K/V bytes. The extend
shapes (sdpa/extend/...) are Q new queries of one request over its 32K keys, as bench_attention_gpu's
extend/... runs them; SDPA runs them non-causal (is_causal aligns the mask to the top-left
corner when there are fewer queries than keys, and an explicit mask would move SDPA off its
fastest backend): the Q x Q causal triangle it then also computes is under 1 % of the work."""
import statistics

import torch
import torch.nn.functional as F

CASES = [(1, 32768), (1, 131072), (16, 32768), (64, 8192)]
HEADS = [(32, 8, 128), (9, 3, 64)]
EXTEND_QUERIES = [4, 8, 16, 64, 256]  # bench_attention_gpu's extend sweep: hq32/hkv8/d128, B1, 32K


def time_sdpa(batch, length, hq, hkv, d, queries=1, runs=50):
    q = torch.randn(batch, hq, queries, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, hkv, length, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, hkv, length, d, device="cuda", dtype=torch.bfloat16)
    scrub = torch.empty(512 << 20, device="cuda", dtype=torch.uint8)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        scrub.fill_(0x5A)
        start.record()
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    us = statistics.median(times)
    kv_bytes = 2 * batch * hkv * length * d * 2
    return us, kv_bytes / us / 1e3


def main():
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for hq, hkv, d in HEADS:
        for batch, length in CASES:
            us, gbps = time_sdpa(batch, length, hq, hkv, d)
            print(f"sdpa/hq{hq}_hkv{hkv}_d{d}/B{batch}/L{length} {us:.1f} us {gbps:.0f} GB/s")
    for queries in EXTEND_QUERIES:
        us, gbps = time_sdpa(1, 32768, 32, 8, 128, queries)
        print(f"sdpa/extend/hq32_hkv8_d128/B1/L32768/Q{queries} {us:.1f} us {gbps:.0f} GB/s")


if __name__ == "__main__":
    main()
