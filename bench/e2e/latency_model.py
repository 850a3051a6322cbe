#!/usr/bin/env python3
"""How far the median of a latency tenant can come down beside training, on a
GPU that never preempts a running kernel: a model of the issue's workload,
for docs/sm-time.md ("Latency tenants", the p50).

The workload is bench/e2e's and LatencyTenantTest's: inference bursts of
BURST ms of GPU work arriving on a PERIOD ms grid, each moved by a uniform
jitter of +-JITTER ms (independent per arrival), and a training tenant whose
KERNEL ms kernels use what the bursts leave. A burst waits for the training
kernel running when it arrives (nothing preempts it); the question is which
training kernels a scheduler should not start, and what that costs the
training. Policies:

  work-conserving  start a training kernel whenever the GPU is free and no
                   burst waits (the driver's behaviour, and fracgpu's today)
  grid-aware       also refuse a kernel that would end later than Q ms after
                   the grid point of the next arrival (a scheduler that has
                   learnt the period and phase, not each arrival's jitter)
  clairvoyant      refuse a kernel that would still run at the next arrival
                   unless the GPU would then idle more than Q ms (a bound: it
                   knows every arrival in advance)

Hand-over costs, from this host's measurements (docs/sm-time.md): GRANT ms
from a burst's arrival to its first kernel when the GPU is free to take
(the daemon's grant), and RESTART ms from a burst's end to the training's
next kernel (the hand-back, a pass, the training's wake-up).

For each policy it prints the setting that keeps the median delay within
the target (1.05 x alone's median) and leaves the training the most, with
the p99 delay. Deterministic (a fixed seed).

  python3 bench/e2e/latency_model.py [--grant 0.05] [--restart 0.17]
"""
import argparse
import random

PERIOD, JITTER, BURST, KERNEL = 10.0, 1.0, 2.0, 2.0
ALONE_P50 = 2.11  # ms, the inference alone without fracgpu (LatencyTenantTest)


def simulate(policy, q, grant, restart, bursts=50_000, seed=1):
    """Returns (median delay, p99 delay, training's share of what the bursts leave)."""
    rng = random.Random(seed)
    arrivals = [PERIOD * k + rng.uniform(-JITTER, JITTER) for k in range(1, bursts + 1)]
    gpu_free = arrivals[0]  # when the GPU finishes the training's last kernel
    delays, training = [], 0.0
    for k in range(bursts - 1):
        start = max(gpu_free, arrivals[k]) + grant
        delays.append(start - arrivals[k])
        t = start + BURST + restart
        next_arrival, next_grid = arrivals[k + 1], PERIOD * (k + 2)
        while t < next_arrival:  # the training's kernels, back to back
            end = t + KERNEL
            if policy == "grid-aware" and end > next_grid + q:
                break
            if policy == "clairvoyant" and end > next_arrival and next_arrival - t <= q:
                break
            training += KERNEL
            t = end
        gpu_free = t
    delays.sort()
    left = (arrivals[-1] - arrivals[0]) * (1 - BURST / PERIOD)
    return delays[len(delays) // 2], delays[int(0.99 * len(delays))], training / left


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grant", type=float, default=0.05, help="ms from arrival to first kernel on a free GPU")
    parser.add_argument("--restart", type=float, default=0.17, help="ms from a burst's end to the training's next kernel")
    args = parser.parse_args()
    target = 0.05 * ALONE_P50
    print(f"period {PERIOD} ms +-{JITTER}, bursts {BURST} ms, training kernels {KERNEL} ms, "
          f"grant {args.grant} ms, restart {args.restart} ms; median delay target <= {target:.3f} ms")
    print(f"{'policy':16} {'setting':>8} {'p50 delay':>10} {'p99 delay':>10} {'training':>9}")
    p50, p99, share = simulate("work-conserving", 0, args.grant, args.restart)
    print(f"{'work-conserving':16} {'-':>8} {p50:10.3f} {p99:10.3f} {share:9.3f}")
    settings = [i / 20 for i in range(-20, 41)]  # -1.0 .. 2.0 ms
    for policy in ("grid-aware", "clairvoyant"):
        best = None
        for q in settings:
            p50, p99, share = simulate(policy, q, args.grant, args.restart, bursts=20_000)
            if p50 <= target and (best is None or share > best[3]):
                best = (q, p50, p99, share)
        if best is None:
            print(f"{policy:16} {'none':>8} (no setting meets the median target)")
        else:
            q, p50, p99, share = best
            print(f"{policy:16} {q:8.2f} {p50:10.3f} {p99:10.3f} {share:9.3f}")


if __name__ == "__main__":
    main()
