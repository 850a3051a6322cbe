#!/usr/bin/env python3
"""Checks the container recipes against a real install and a running daemon.

docs/containers.md and examples/k8s/*.yaml name host paths (the library, the
binaries, the example config, the systemd unit, tenant directories); each must
exist in the install layout (`cmake --install --prefix PREFIX`, standing in for
/usr) or under the daemon's run dir (standing in for /run/fracgpu). The
manifests must parse and hold what the docs promise. The ConfigMap's node
config is written to --toml-out so the caller can run `fracgpud --check` on it.

Usage: check_recipes.py --source DIR --prefix DIR --run-dir DIR --toml-out FILE
"""
import argparse
import pathlib
import re
import sys

import yaml

errors = []


def fail(where, message):
    errors.append(f"{where}: {message}")


def host_path(path, prefix, run_dir):
    """The file standing in for a host path of the recipes, or None if the
    path is not one the install or the daemon provides."""
    if path.startswith("/usr/local/"):
        return prefix / path[len("/usr/local/"):]
    if path.startswith("/usr/"):
        return prefix / path[len("/usr/"):]
    if path == "/etc/fracgpu/fracgpud.toml":
        return prefix / "share/fracgpu/fracgpud.toml"  # the docs say: copy it there
    if path == "/etc/fracgpu":
        return prefix / "share/fracgpu"
    if path.startswith("/lib/systemd/system/"):
        return prefix / path.lstrip("/")
    if path.startswith("/run/fracgpu"):
        # The test's daemon runs tenant "alice"; any tenant name stands for it.
        rest = re.sub(r"^/run/fracgpu/?", "", path)
        rest = re.sub(r"^tenants/[a-z0-9][a-z0-9_.-]*", "tenants/alice", rest)
        return run_dir / rest
    return None


def check_host_path(where, path, prefix, run_dir):
    target = host_path(path, prefix, run_dir)
    if target is None:
        fail(where, f"{path}: not a path of the install layout or the run dir")
    elif not target.exists():
        fail(where, f"{path}: missing from the install layout ({target} does not exist)")


def check_docs(doc, prefix, run_dir):
    text = doc.read_text()
    blocks = re.findall(r"```(?:sh|bash)\n(.*?)```", text, re.S)
    if not blocks:
        fail(doc, "no shell recipe")
    found = {"docker run": False, "ld.so.preload": False, "--runtime=nvidia": False, "--gpus": False}
    for block in blocks:
        for key in found:
            found[key] |= key in block
        # Host side of every -v HOST:CONTAINER[:ro]; every LD_PRELOAD must be
        # a file some -v of the same command mounts.
        for command in re.split(r"\n(?=\S)", block.replace("\\\n", " ")):
            if "docker run" not in command:
                continue
            mounts = re.findall(r"-v\s+(\S+?):(\S+?)(?::ro)?(?=\s)", command + " ")
            for host, _ in mounts:
                check_host_path(f"{doc}: docker run", host, prefix, run_dir)
            targets = {container for _, container in mounts}
            for preload in re.findall(r"LD_PRELOAD=(\S+)", command):
                if preload not in targets:
                    fail(f"{doc}: docker run", f"LD_PRELOAD={preload} is not mounted into the container")
            if "/run/fracgpu/tenant/policy" not in targets:
                fail(f"{doc}: docker run", "the tenant's policy is not mounted read-only over the tenant dir")
    for key, seen in found.items():
        if not seen:
            fail(doc, f"no recipe uses {key}")
    # Host paths named anywhere else in the shell recipes (install, systemd).
    for block in blocks:
        # (A path right after ':' is the container side of a mount: skipped.)
        for path in re.findall(r"(?<![\w:.-])(/(?:usr|lib/systemd|etc/fracgpu)[\w./-]*fracgpu[\w./-]*)", block):
            check_host_path(doc, path, prefix, run_dir)


def walk_containers(spec):
    return list(spec.get("initContainers", [])) + list(spec.get("containers", []))


def check_manifest(path, prefix, run_dir, toml_out):
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError as e:
        fail(path, f"does not parse: {e}")
        return {}
    kinds = {}
    for d in docs:
        for key in ("apiVersion", "kind", "metadata"):
            if key not in d:
                fail(path, f"a document without {key}")
        kinds[d.get("kind")] = d
        if d.get("kind") == "ConfigMap":
            toml = d.get("data", {}).get("fracgpud.toml")
            if toml is None:
                fail(path, "ConfigMap has no fracgpud.toml")
            else:
                pathlib.Path(toml_out).write_text(toml)
        pod = None
        if d.get("kind") == "DaemonSet":
            pod = d["spec"]["template"]["spec"]
            labels = d["spec"]["template"]["metadata"].get("labels", {})
            if d["spec"]["selector"]["matchLabels"].items() - labels.items():
                fail(path, "DaemonSet selector does not match its pod template")
        elif d.get("kind") == "Pod":
            pod = d["spec"]
        if pod is None:
            continue
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for v in volumes.values():
            if "hostPath" in v:
                check_host_path(f"{path}: volume {v['name']}", v["hostPath"]["path"], prefix, run_dir)
        for c in walk_containers(pod):
            where = f"{path}: container {c['name']}"
            mounts = c.get("volumeMounts", [])
            for m in mounts:
                if m["name"] not in volumes:
                    fail(where, f"mounts undefined volume {m['name']}")
            # The image is the install layout with prefix /usr.
            command = c.get("command", [])
            if command and command[0].startswith("/usr/"):
                check_host_path(where, command[0], prefix, run_dir)
            for e in c.get("env", []):
                if e["name"] == "LD_PRELOAD":
                    covering = [m for m in mounts if e["value"].startswith(m["mountPath"].rstrip("/") + "/")]
                    if not covering:
                        fail(where, f"LD_PRELOAD {e['value']} is not under any volume mount")
                    for m in covering:
                        host = volumes[m["name"]].get("hostPath", {}).get("path")
                        if host:
                            check_host_path(where, host + e["value"][len(m["mountPath"].rstrip("/")):], prefix, run_dir)
            if d.get("kind") == "Pod":
                policy = [m for m in mounts if m["mountPath"] == "/run/fracgpu/tenant/policy"]
                if not policy or not policy[0].get("readOnly"):
                    fail(where, "the tenant's policy must be mounted read-only at /run/fracgpu/tenant/policy")
    return kinds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--source", required=True, type=pathlib.Path)
    parser.add_argument("--prefix", required=True, type=pathlib.Path)
    parser.add_argument("--run-dir", required=True, type=pathlib.Path)
    parser.add_argument("--toml-out", required=True)
    args = parser.parse_args()
    check_docs(args.source / "docs/containers.md", args.prefix, args.run_dir)
    kinds = {}
    manifests = sorted((args.source / "examples/k8s").glob("*.yaml"))
    for manifest in manifests:
        kinds.update(check_manifest(manifest, args.prefix, args.run_dir, args.toml_out))
        installed = args.prefix / "share/fracgpu/k8s" / manifest.name
        if not installed.exists():
            fail(manifest, f"not installed ({installed})")
    for kind in ("ConfigMap", "DaemonSet", "Pod"):
        if kind not in kinds:
            fail("examples/k8s", f"no {kind}")
    for e in errors:
        print(e, file=sys.stderr)
    print(f"checked docs/containers.md and {len(manifests)} manifest(s): {len(errors)} problem(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
