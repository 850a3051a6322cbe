#!/usr/bin/env python3
"""PyTorch workload of the real-GPU benchmark (bench/gpu/run_gpu.sh).

  torch_workload.py --seconds S [--start-file F | --start-ns NS] [--ready-file F]
                    [--size 8192] [--sync-every 8]

A matmul loop on CUDA device 0 (fp16 size x size, the output fed back so no
iteration can be skipped), synchronizing every --sync-every iterations. Prints
one JSON line: iterations, seconds, rate (iterations/s), gpu_time_s,
gpu_fraction.

GPU time comes from torch.profiler with CUDA activities, which is CUPTI's
kernel activity records: the sum of the device time of every kernel the loop
ran inside the window (one stream, so kernels do not overlap). CUDA events
would not do: the time between two events on a stream includes the time the
GPU spent on other processes' work. The profiler runs for the whole window;
its cost (a record per kernel, a few thousand kernels) is the same in every
configuration compared, so it does not bias the ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def kernel_device_us(prof) -> float:
    """Total device time (µs) of the profiled kernels, across PyTorch versions
    (self_device_time_total from 2.4, self_cuda_time_total before)."""
    total = 0.0
    for evt in prof.key_averages():
        value = getattr(evt, "self_device_time_total", None)
        if value is None:
            value = getattr(evt, "self_cuda_time_total", 0.0)
        total += value
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--start-file")
    ap.add_argument("--start-ns", type=int, default=0)
    ap.add_argument("--ready-file")
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--sync-every", type=int, default=8)
    args = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        print("torch_workload.py: PyTorch sees no CUDA device", file=sys.stderr)
        return 1
    dev = torch.device("cuda", 0)
    a = torch.randn(args.size, args.size, device=dev, dtype=torch.float16)
    b = torch.randn(args.size, args.size, device=dev, dtype=torch.float16) / args.size ** 0.5
    for _ in range(3):  # warm-up: cuBLAS handles, kernel selection
        a = torch.matmul(a, b)
    torch.cuda.synchronize()

    if args.ready_file:
        Path(args.ready_file).write_text("ready\n")
    start = args.start_ns
    while args.start_file and not start:
        try:
            start = int(Path(args.start_file).read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            time.sleep(0.002)
    while now_ns() < start:
        time.sleep(0.0002)

    iterations = 0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = now_ns()
        end = t0 + int(args.seconds * 1e9)
        while now_ns() < end:
            for _ in range(args.sync_every):
                a = torch.matmul(a, b)
            torch.cuda.synchronize()
            iterations += args.sync_every
        wall = (now_ns() - t0) / 1e9
    gpu_s = kernel_device_us(prof) / 1e6
    print(json.dumps({"mode": "torch", "kernels": iterations, "seconds": round(wall, 3),
                      "rate": round(iterations / wall, 2), "gpu_time_s": round(gpu_s, 4),
                      "gpu_fraction": round(gpu_s / wall, 4), "size": args.size, "pid": os.getpid()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
