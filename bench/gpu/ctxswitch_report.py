#!/usr/bin/env python3
"""What CUPTI's context-switch records show, from tests/gpu/run_timeslice.sh's
third run: two timeslice_probe processes spinning on the GPU and one that
runs nothing (--idle), each with the CUPTI meter asking for the records
(FRACGPU_CUPTI_CTX_SWITCH=1, bench/gpu/cupti_meter.cpp).

    ctxswitch_report.py --spinner PROBE_LOG METER_JSON [--spinner ...] --idle METER_JSON [--json OUT]
    ctxswitch_report.py --self-test

The questions (docs/gpu-results.md): do the records come at all on this
driver (CUPTI 13.1 added the kind; an older CUPTI refuses it), does a
spinning process's count follow its own switches (the gaps its probe saw on
the GPU's global timer: each gap is one switch out and one back in), and
does a process receive other processes' switches: the idle one's records
while the others spin (its own context runs nothing then). If it does, a
process other than a tenant's can see when each context held the GPU, which
no timing of a tenant's work could hide (docs/sm-time.md, "Limits").

Prints a line per process and a verdict; --json writes the figures. Exit 0
when the meters' files could be read (whatever they say); 1 when a file is
missing or unreadable; 64 on bad arguments.
"""
import argparse
import json
import sys

# The idle process's records inside the spin window that say "it sees the
# others": at least this many, and this fraction of the spinners' gaps.
SEES_OTHERS_MIN = 10
SEES_OTHERS_FRACTION = 0.1


def load(path):
    with open(path) as f:
        return json.loads(f.read())


def spin_window(meter):
    """The spinner's measured kernels, on CLOCK_MONOTONIC: (first start, last end)."""
    a, b = meter.get("first_start_mono_ns"), meter.get("last_end_mono_ns")
    return (a, b) if a is not None and b is not None and b > a else None


def figures(spinners, idle):
    """spinners: [(probe log, meter)], idle: meter. The report as a dict."""
    meters = [m for _, m in spinners] + [idle]
    errors = sorted({m["ctx_switch"].get("error", "") for m in meters if not m.get("ctx_switch", {}).get("enabled")})
    out = {"enabled": not errors, "errors": [e for e in errors if e], "processes": []}
    windows = [w for w in (spin_window(m) for _, m in spinners) if w]
    window = (max(w[0] for w in windows), min(w[1] for w in windows)) if windows else None
    if window and window[1] <= window[0]:
        window = None
    out["window_ns"] = list(window) if window else None

    def in_window(events):
        return [e for e in events if window and window[0] <= e[0] < window[1]]

    total_gaps = 0
    for log, meter in spinners:
        cs = meter.get("ctx_switch", {})
        own = set(cs.get("own_contexts", []))
        events = in_window(cs.get("events", []))
        gaps = len(log.get("gaps", []))
        total_gaps += gaps
        out["processes"].append({
            "role": "spinner", "pid": meter.get("pid"), "records": cs.get("records", 0), "gaps": gaps,
            "in_window": len(events), "own_in_window": sum(1 for e in events if e[1] in own),
            "other_in_window": sum(1 for e in events if e[1] not in own),
            "own_contexts": sorted(own), "contexts": cs.get("contexts", {})})
    cs = idle.get("ctx_switch", {})
    idle_events = in_window(cs.get("events", []))
    out["processes"].append({
        "role": "idle", "pid": idle.get("pid"), "records": cs.get("records", 0), "in_window": len(idle_events),
        "own_contexts": sorted(cs.get("own_contexts", [])), "contexts": cs.get("contexts", {})})
    if not out["enabled"]:
        verdict = "unknown: CUPTI here does not give the records (" + "; ".join(out["errors"]) + ")"
        sees = None
    elif window is None:
        verdict = "unknown: no spin window in the spinners' meters (did their kernels run?)"
        sees = None
    elif len(idle_events) >= max(SEES_OTHERS_MIN, SEES_OTHERS_FRACTION * total_gaps):
        verdict = (f"yes: the idle process received {len(idle_events)} records while the others spun "
                   f"({total_gaps} gaps between them)")
        sees = True
    elif not idle_events:
        verdict = f"no: the idle process received none while the others spun ({total_gaps} gaps between them)"
        sees = False
    else:
        verdict = (f"unclear: the idle process received {len(idle_events)} records while the others spun "
                   f"({total_gaps} gaps between them)")
        sees = None
    out["sees_other_processes"] = sees
    out["verdict"] = verdict
    out["records_come"] = out["enabled"] and any(p["records"] > 0 for p in out["processes"])
    return out


def text(report):
    lines = []
    if report["enabled"]:
        lines.append("CUPTI context-switch records: enabled in every process")
    else:
        lines.append("CUPTI context-switch records: refused: " + "; ".join(report["errors"]))
    for p in report["processes"]:
        if p["role"] == "spinner":
            lines.append(f"  spinner pid {p['pid']}: {p['records']} records, {p['in_window']} in the spin window "
                         f"({p['own_in_window']} of its own contexts {p['own_contexts']}, {p['other_in_window']} of "
                         f"others); its probe saw {p['gaps']} gaps (each a switch out and back in)")
        else:
            lines.append(f"  idle pid {p['pid']}: {p['records']} records, {p['in_window']} in the spin window "
                         f"(its own contexts {p['own_contexts']})")
    lines.append("records come on this driver: " + ("yes" if report["records_come"] else "no"))
    lines.append("a process sees other processes' switches: " + report["verdict"])
    return "\n".join(lines)


def self_test():
    def meter(pid, events, own, enabled=True, window=None):
        m = {"pid": pid, "first_start_mono_ns": window[0] if window else None,
             "last_end_mono_ns": window[1] if window else None,
             "ctx_switch": {"enabled": enabled, "records": len(events), "own_contexts": own,
                            "contexts": {}, "events": events}}
        if not enabled:
            m["ctx_switch"]["error"] = "CUPTI (API version 130001) refused the context-switch records: invalid kind"
        return m

    w = (1_000_000, 3_000_000_000)
    gaps = [[i, i + 1] for i in range(200)]
    # Each spinner sees its own switches only; the idle one gets nothing.
    own_only = [({"gaps": gaps}, meter(1, [[w[0] + i * 1000, 1, 1 + i % 2] for i in range(400)], [1], window=w)),
                ({"gaps": gaps}, meter(2, [[w[0] + i * 1000, 1, 1 + i % 2] for i in range(400)], [1], window=w))]
    r = figures(own_only, meter(3, [[10, 1, 1], [20, 1, 2]], [1]))
    assert r["enabled"] and r["records_come"] and r["sees_other_processes"] is False, r
    assert r["processes"][0]["own_in_window"] == 400 and r["processes"][2]["in_window"] == 0, r
    # The idle one receives the others' switches.
    r = figures(own_only, meter(3, [[w[0] + i * 5000, 7 + i % 2, 1 + i % 2] for i in range(300)], [1]))
    assert r["sees_other_processes"] is True and "yes" in r["verdict"], r
    # A few stray records: unclear, not a yes.
    r = figures(own_only, meter(3, [[w[0] + 5, 7, 1], [w[0] + 9, 7, 2]], [1]))
    assert r["sees_other_processes"] is None and r["verdict"].startswith("unclear"), r
    # An old CUPTI: unknown, with its error.
    old = [({"gaps": gaps}, meter(1, [], [], enabled=False, window=w))]
    r = figures(old, meter(3, [], [], enabled=False))
    assert not r["enabled"] and not r["records_come"] and r["verdict"].startswith("unknown: CUPTI"), r
    assert "invalid kind" in text(r), text(r)
    # Spinners whose kernels never ran: no window, unknown.
    r = figures([({"gaps": []}, meter(1, [], [1]))], meter(3, [[5, 7, 1]] * 20, [1]))
    assert r["window_ns"] is None and r["verdict"].startswith("unknown: no spin window"), r
    print("ctxswitch_report.py self-test: ok")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spinner", nargs=2, action="append", metavar=("PROBE_LOG", "METER_JSON"), default=[])
    ap.add_argument("--idle", metavar="METER_JSON")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        return self_test()
    if not args.spinner or not args.idle:
        ap.print_usage(sys.stderr)
        return 64
    try:
        spinners = [(load(log), load(m)) for log, m in args.spinner]
        idle = load(args.idle)
    except (OSError, ValueError) as e:
        print(f"ctxswitch_report.py: {e}", file=sys.stderr)
        return 1
    report = figures(spinners, idle)
    print(text(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
