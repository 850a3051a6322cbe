#!/usr/bin/env python3
"""The kubelet plugin accepts exactly the command line deploy/daemonset.yaml
gives it: runs the binary with those arguments (and --uninstall, which stops
before touching the node) outside a cluster, where it must get past its flags
and stop at the missing in-cluster credentials. Also runs it once with an
unknown flag, which must be refused: the check can fail.

Usage: check_daemonset_flags.py --plugin BIN --daemonset deploy/daemonset.yaml
"""
import argparse
import os
import subprocess
import sys

import yaml


def plugin_command(path):
    with open(path) as f:
        for doc in yaml.safe_load_all(f):
            if not doc or doc.get("kind") != "DaemonSet":
                continue
            for container in doc["spec"]["template"]["spec"]["containers"]:
                if container["name"] == "kubelet-plugin":
                    return container["command"]
    sys.exit(f"{path}: no DaemonSet container named kubelet-plugin")


def run(plugin, args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    return subprocess.run([plugin] + args, capture_output=True, text=True, timeout=30, env=env)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--plugin", required=True)
    parser.add_argument("--daemonset", required=True)
    opts = parser.parse_args()
    command = plugin_command(opts.daemonset)
    # $(NODE_NAME) is the kubelet's substitution from the pod's env.
    args = [a.replace("$(NODE_NAME)", "node-1") for a in command[1:]] + ["--uninstall"]
    ok = run(opts.plugin, args)
    if ok.returncode != 1 or "the API server:" not in ok.stderr:
        print(f"FAIL: {command[0]} with the DaemonSet's arguments {args}: exit {ok.returncode}\n{ok.stderr}")
        return 1
    bad = run(opts.plugin, args + ["--no-such-flag"])
    if bad.returncode in (0, 1):
        print(f"FAIL: an unknown flag was not refused (exit {bad.returncode})\n{bad.stderr}")
        return 1
    print(f"ok: the DaemonSet's {len(command) - 1} arguments are accepted; an unknown flag is refused")
    return 0


if __name__ == "__main__":
    sys.exit(main())
