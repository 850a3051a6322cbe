#!/usr/bin/env python3
"""PyTorch workload of the real-GPU benchmark (bench/gpu/run_gpu.sh).

  torch_workload.py --seconds S [--start-file F | --start-ns NS] [--ready-file F]
                    [--size 8192] [--sync-every 8] [--no-profiler]

A matmul loop on CUDA device 0 (fp16 size x size, the output fed back so no
iteration can be skipped), synchronizing every --sync-every iterations. Prints
one JSON line: iterations, seconds, rate (iterations/s), profiler (0/1),
gpu_time_s, gpu_fraction (null with --no-profiler).

GPU time comes from torch.profiler with CUDA activities, which is CUPTI's
kernel activity records: the sum of the device time of the CUDA (device-side)
events the loop ran (one stream, so kernels do not overlap). The profiler is
started before the ready file is written, so it is running when the common
start comes in every process. A kernel's start-end includes time in which
another process's context held the GPU (time-slicing) or ran beside it (MPS):
the figure is a share of the GPU only where one process's kernels run at a time
(fracgpu tenants). The profiler adds a cost to every kernel, so throughput is
measured in separate runs with --no-profiler (run_gpu.sh).
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


def is_device_event(evt) -> bool:
    """A device-side (CUDA) event: a kernel, memcpy or memset, not a CPU op
    (whose device time would count its kernels a second time)."""
    kind = getattr(evt, "device_type", None)
    if kind is None:
        return False
    # By the enum's name where it has one: str() of a pybind11 enum reads
    # "DeviceType.CUDA", but of a Python IntEnum (pybind11 3's native enums)
    # on Python 3.11+ it reads the number, which would count no event at all.
    name = getattr(kind, "name", None)
    return (name if isinstance(name, str) else str(kind).rsplit(".", 1)[-1]) == "CUDA"


def event_us(evt) -> float:
    """One device event's duration (µs), across PyTorch versions
    (self_device_time_total from 2.4, self_cuda_time_total before, else its
    time range)."""
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(evt, attr, None)
        if value:
            return float(value)
    time_range = getattr(evt, "time_range", None)
    return float(time_range.elapsed_us()) if time_range is not None else 0.0


def kernel_device_us(prof) -> float:
    """Total device time (µs) of the profiled device events."""
    return sum(event_us(evt) for evt in prof.events() if is_device_event(evt))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--start-file")
    ap.add_argument("--start-ns", type=int, default=0)
    ap.add_argument("--ready-file")
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--no-profiler", action="store_true", help="measure throughput only (no GPU time)")
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

    # Started before the ready file: its start-up (CUPTI's) is part of the
    # warm-up, not of the window. Nothing runs on the GPU until the start.
    prof = None if args.no_profiler else profile(activities=[ProfilerActivity.CUDA])
    if prof is not None:
        prof.__enter__()
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
    t0 = now_ns()
    end = t0 + int(args.seconds * 1e9)
    while now_ns() < end:
        for _ in range(args.sync_every):
            a = torch.matmul(a, b)
        torch.cuda.synchronize()
        iterations += args.sync_every
    wall = (now_ns() - t0) / 1e9
    gpu_s = None
    if prof is not None:
        prof.__exit__(None, None, None)
        gpu_s = kernel_device_us(prof) / 1e6
    print(json.dumps({"mode": "torch", "kernels": iterations, "seconds": round(wall, 3),
                      "rate": round(iterations / wall, 2), "profiler": int(prof is not None),
                      "gpu_time_s": None if gpu_s is None else round(gpu_s, 4),
                      "gpu_fraction": None if gpu_s is None else round(gpu_s / wall, 4),
                      "size": args.size, "pid": os.getpid()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
