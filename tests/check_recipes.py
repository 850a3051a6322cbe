#!/usr/bin/env python3
"""Checks the container recipes against a real install and a running daemon.

docs/containers.md and examples/k8s/*.yaml name host paths (the library, the
binaries, the example config, the systemd unit, tenant directories); each must
exist in the install layout (`cmake --install --prefix PREFIX`, standing in for
/usr) or under the daemon's run dir (standing in for /run/fracgpu). The
manifests must parse and hold what the docs promise. The ConfigMap's node
config is written to --toml-out so the caller can run `fracgpud --check` on it.

The tenant's directory must be mounted read-only at /run/fracgpu/tenant, with
its usage file alone mounted read-write over it at /run/fracgpu/tenant/usage
(docs/containers.md): a read-write tenant directory is rejected, in docker
recipes and pod manifests alike.

Two operational mistakes are rejected as well: a reload that signals PID 1
while the DaemonSet runs with hostPID (PID 1 is then the host's init, not
fracgpud; the reload must read the daemon's pid file, which must exist in the
running daemon's run dir), and a container that writes the host's interposer
in place (cp, install, dd, a redirect) instead of copying it to a temporary
file in the same directory and renaming that over it: a tenant process that
has the library mapped can crash when its pages change underneath it.

Usage: check_recipes.py --source DIR --prefix DIR --run-dir DIR --toml-out FILE
"""
import argparse
import pathlib
import posixpath
import re
import shlex
import sys

import yaml

errors = []
# Gathered over the docs and every manifest, checked at the end: the reload
# commands named, whether a DaemonSet uses hostPID, the ConfigMap's run dirs,
# the containers that install the interposer by a rename.
gathered = {"reloads": [], "host_pid": False, "run_dirs": set(), "library_installs": []}

# The interposer on the host, as the install layout puts it and tenant pods
# mount it (docs/containers.md).
LIBRARY = "/usr/lib/fracgpu/libfracgpu.so"
# Where a container gets its tenant's directory, and the one file in it that it
# may write (docs/containers.md).
TENANT_MOUNT = "/run/fracgpu/tenant"
USAGE_MOUNT = TENANT_MOUNT + "/usage"
# The daemon's pid file, in its run dir (kPidFileName in controller/state/run_dir.h).
PID_FILE_NAME = "fracgpud.pid"
# kill -HUP PID, kill -s HUP PID, kill -SIGHUP PID, kill -1 PID: the target.
RELOAD = re.compile(r"\bkill\s+(?:-s\s*(?:SIG)?HUP|-(?:SIG)?HUP|-1)\s+(\S*\$\([^)]*\)\S*|\S+)")


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
    gathered["reloads"] += reload_targets(doc, text)
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
            # -v HOST:CONTAINER[:OPTIONS]
            mounts = re.findall(r"-v\s+([^\s:]+):([^\s:]+)(?::(\S+))?(?=\s)", command + " ")
            for host, _, _ in mounts:
                check_host_path(f"{doc}: docker run", host, prefix, run_dir)
            targets = {container for _, container, _ in mounts}
            for preload in re.findall(r"LD_PRELOAD=(\S+)", command):
                if preload not in targets:
                    fail(f"{doc}: docker run", f"LD_PRELOAD={preload} is not mounted into the container")
            check_tenant_mounts(f"{doc}: docker run",
                                [(host, container, "ro" in options.split(","))
                                 for host, container, options in mounts])
    for key, seen in found.items():
        if not seen:
            fail(doc, f"no recipe uses {key}")
    # Host paths named anywhere else in the shell recipes (install, systemd).
    for block in blocks:
        # (A path right after ':' is the container side of a mount: skipped.)
        for path in re.findall(r"(?<![\w:.-])(/(?:usr|lib/systemd|etc/fracgpu)[\w./-]*fracgpu[\w./-]*)", block):
            check_host_path(doc, path, prefix, run_dir)


def check_tenant_mounts(where, mounts):
    """mounts: (host path, container path, read_only). The tenant directory
    must be mounted read-only and its usage file read-write over it."""
    tenant = [(h, ro) for h, c, ro in mounts if c.rstrip("/") == TENANT_MOUNT]
    usage = [(h, ro) for h, c, ro in mounts if c == USAGE_MOUNT]
    if not tenant:
        fail(where, f"the tenant's directory is not mounted at {TENANT_MOUNT}")
        return
    host_dir, read_only = tenant[0]
    if not read_only:
        fail(where, f"the tenant's directory is mounted read-write at {TENANT_MOUNT}: mount it read-only "
                    "(a tenant that can write it can plant links and FIFOs under the daemon's names, remove "
                    "its usage file, or truncate the daemon's files under it), and its usage file alone "
                    f"read-write at {USAGE_MOUNT}")
    if not usage:
        fail(where, f"the tenant's usage file is not mounted read-write at {USAGE_MOUNT} (processes could not "
                    "charge through a read-only directory)")
        return
    usage_host, usage_ro = usage[0]
    if usage_ro:
        fail(where, f"the tenant's usage file is mounted read-only at {USAGE_MOUNT}: processes could not charge")
    if usage_host != host_dir.rstrip("/") + "/usage":
        fail(where, f"{USAGE_MOUNT} is {usage_host}, not the usage file of the tenant directory {host_dir}")


def reload_targets(where, text):
    """(where, target) of every reload signal named in text; a target that
    reads a pid file is given as that file's path."""
    found = []
    for match in RELOAD.finditer(text):
        target = match.group(1).strip("\"'`.,;:")
        pid_file = re.match(r"\$\((?:cat\s+|<\s*)([^)\s]+)\s*\)", target)
        found.append((where, pid_file.group(1) if pid_file else target))
    return found


def check_reloads(reloads, host_pid, run_dirs, prefix, run_dir):
    """Each reload must reach fracgpud: not PID 1 under hostPID, and a pid
    file that is the daemon's (in the ConfigMap's run dir, present in the
    test daemon's run dir)."""
    for where, target in reloads:
        if target.isdigit():
            if host_pid:
                fail(where, f"reload signals PID {target}: with hostPID the pod shares the host's PIDs "
                            f"(PID 1 is the host's init); signal the PID in {PID_FILE_NAME}")
            continue
        if posixpath.basename(target) != PID_FILE_NAME or posixpath.dirname(target) not in run_dirs:
            fail(where, f"reload reads {target}, not the daemon's pid file "
                        f"({', '.join(d + '/' + PID_FILE_NAME for d in sorted(run_dirs))})")
        else:
            check_host_path(where, target, prefix, run_dir)


def host_mounts(pod, container):
    """mountPath -> host path for the container's hostPath mounts."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {}
    for m in container.get("volumeMounts", []):
        host = volumes.get(m["name"], {}).get("hostPath", {}).get("path")
        if host:
            mounts[m["mountPath"].rstrip("/") or "/"] = host.rstrip("/") or "/"
    return mounts


def to_host(path, mounts):
    """The host path a container path is, through a hostPath mount, or None."""
    for mount, host in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        if path == mount or path.startswith(mount + "/"):
            return host + path[len(mount):]
    return None


def simple_commands(argv):
    """The simple commands (argument lists) a container command runs, with
    the paths its redirects write; `sh -c SCRIPT` is split into its parts."""
    if len(argv) >= 2 and posixpath.basename(argv[0]) in ("sh", "bash", "ash", "dash"):
        script = None
        for i, a in enumerate(argv[1:], 1):
            if a.startswith("-") and "c" in a[1:] and i + 1 < len(argv):
                script = argv[i + 1]
                break
        if script is not None:
            commands, redirects = [], re.findall(r"(?<![0-9&<])>>?\s*([^\s;&|]+)", script)
            for part in re.split(r"&&|\|\||[;|\n]", script):
                try:
                    words = shlex.split(re.sub(r"\d*>>?\s*[^\s;&|]+", " ", part))
                except ValueError:
                    words = part.split()
                if words:
                    commands.append(words)
            return commands, redirects
    return [list(argv)], []


def check_library_writes(where, pod, container, library_installs, library=LIBRARY):
    """Rejects an in-place write of the host's interposer (at `library` on
    the host); counts each rename onto it from a file in the same directory."""
    mounts = host_mounts(pod, container)
    commands, redirects = simple_commands(list(container.get("command", [])) + list(container.get("args", [])))
    in_place = "writes the host's interposer with {} instead of renaming a copy over it: a tenant process " \
               "that has it mapped can crash (or one starting meanwhile miss it); copy it to a temporary " \
               "file in the same directory and mv that over it"

    def target(src, dest):
        host = to_host(dest.rstrip("/") or "/", mounts)
        if host is not None and (dest.endswith("/") or host == posixpath.dirname(library)):
            host = posixpath.join(host, posixpath.basename(src))  # into a directory
        return host

    for dest in redirects:
        if to_host(dest, mounts) == library:
            fail(where, in_place.format("a redirect"))
    for words in commands:
        name = posixpath.basename(words[0])
        operands = [w for w in words[1:] if not w.startswith("-")]
        if name == "dd":
            for w in words[1:]:
                if w.startswith("of=") and to_host(w[3:], mounts) == library:
                    fail(where, in_place.format("dd"))
            continue
        if name in ("cp", "install", "tee"):  # (rsync renames unless --inplace)
            dests = operands if name == "tee" else operands[-1:]
            srcs = operands[:-1] or [""]
            for dest in dests:
                if target(srcs[-1], dest) == library:
                    fail(where, in_place.format(name))
        if name == "mv" and len(operands) >= 2:
            src, dest = operands[-2], operands[-1]
            if target(src, dest) != library:
                continue
            src_host = to_host(src, mounts)
            if src_host is None or posixpath.dirname(src_host) != posixpath.dirname(library):
                fail(where, f"mv onto the host's interposer from {src}, not from the same directory: "
                            "not an atomic rename")
            else:
                library_installs.append(where)


def walk_containers(spec):
    return list(spec.get("initContainers", [])) + list(spec.get("containers", []))


def check_manifest(path, prefix, run_dir, toml_out):
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError as e:
        fail(path, f"does not parse: {e}")
        return {}
    gathered["reloads"] += reload_targets(path, path.read_text())  # comments included
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
                gathered["run_dirs"].update(re.findall(r'^\s*run_dir\s*=\s*"([^"]+)"', toml, re.M) or ["/run/fracgpu"])
        pod = None
        if d.get("kind") == "DaemonSet":
            pod = d["spec"]["template"]["spec"]
            labels = d["spec"]["template"]["metadata"].get("labels", {})
            if d["spec"]["selector"]["matchLabels"].items() - labels.items():
                fail(path, "DaemonSet selector does not match its pod template")
            gathered["host_pid"] |= bool(pod.get("hostPID"))
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
            check_library_writes(where, pod, c, gathered["library_installs"] if d.get("kind") == "DaemonSet" else [])
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
                hosts = host_mounts(pod, c)
                check_tenant_mounts(where, [(hosts.get(m["mountPath"].rstrip("/"), ""), m["mountPath"],
                                             bool(m.get("readOnly"))) for m in mounts])
                for m in mounts:
                    volume = volumes.get(m["name"], {})
                    if m["mountPath"] == USAGE_MOUNT and volume.get("hostPath", {}).get("type") != "File":
                        fail(where, f"the volume mounted at {USAGE_MOUNT} must be a hostPath of type File "
                                    "(the daemon's file, never one made by the kubelet)")
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
    if not any(where == args.source / "docs/containers.md" for where, _ in gathered["reloads"]):
        fail("docs/containers.md", "no reload command (SIGHUP to fracgpud)")
    check_reloads(gathered["reloads"], gathered["host_pid"], gathered["run_dirs"], args.prefix, args.run_dir)
    if "DaemonSet" in kinds and not gathered["library_installs"]:
        fail("examples/k8s", f"the DaemonSet does not install {LIBRARY} by a rename from the same directory")
    for e in errors:
        print(e, file=sys.stderr)
    print(f"checked docs/containers.md and {len(manifests)} manifest(s): {len(errors)} problem(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
