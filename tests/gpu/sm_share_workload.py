#!/usr/bin/env python3
"""A saturating PyTorch workload for the real-GPU GPU-time check.

    sm_share_workload.py START_NS SECONDS SIZE

Waits until CLOCK_MONOTONIC reaches START_NS (so tenants start together),
then runs SIZE x SIZE fp16 matmuls for SECONDS, synchronizing every 8, and
prints one JSON line: iterations, wall seconds, iterations per second.
Throughput is the independent measure: against the same workload alone on
the GPU, a tenant's throughput ratio is the share of GPU time it really got
(each matmul takes the same GPU time whoever else is on the GPU, because
fracgpu gives the GPU to one tenant at a time).
"""
import json
import sys
import time

import torch


def main() -> None:
    start_ns, seconds, size = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    a = torch.randn(size, size, device="cuda", dtype=torch.float16)
    b = torch.randn(size, size, device="cuda", dtype=torch.float16)
    for _ in range(3):  # warm up cuBLAS outside the measured time
        a @ b
    torch.cuda.synchronize()
    while time.clock_gettime_ns(time.CLOCK_MONOTONIC) < start_ns:
        time.sleep(0.001)
    t0 = time.monotonic()
    iterations = 0
    while time.monotonic() - t0 < seconds:
        for _ in range(8):
            a @ b
        torch.cuda.synchronize()
        iterations += 8
    wall = time.monotonic() - t0
    print(json.dumps({"iterations": iterations, "wall_s": wall, "per_s": iterations / wall}))


if __name__ == "__main__":
    main()
