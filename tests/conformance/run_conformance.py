#!/usr/bin/env python3
"""Driver conformance: libfracgpu.so against real NVIDIA driver releases.

The NVIDIA user-space driver answers cuGetProcAddress and dlsym without a
GPU. For each release below this test asks it, with and without the
interposer preloaded (conformance_probe), for every symbol the interposer
hooks with every cudaVersion and flags value, through cuGetProcAddress,
cuGetProcAddress_v2 (with and without a status pointer) and dlsym, and for
every other exported symbol with a few; the same for the NVML symbols on the
release's libnvidia-ml.so.1; and it loads the CUDA 12 and CUDA 13 runtimes
against the release and records every entry point each obtains
(record_getproc.so). The CUDA 13 runtime is 13.0, the one PyTorch's cu130
builds ship; it refuses a driver older than 580 (none is in Debian's
archive), but only after its lookups, which are what is compared.
The interposer must hand out its own hook of exactly the variant the driver
returns, refuse exactly where the driver refuses, and leave every unhooked
symbol untouched.

The packages come from Debian's non-free archive (apt-get download with a
private sources list and state, never the machine's apt configuration) and
the runtimes from PyPI (pip download), into a cache kept between runs:
$FRACGPU_CONFORMANCE_CACHE, default ~/.cache/fracgpu-conformance. If they
cannot be had (no network, no Debian mirror configured), the test says so and
exits 77, which CTest reports as skipped.

Usage: run_conformance.py --probe P --recorder R --interposer L --hooks D --nvml-hooks D [--report F]
"""
import argparse
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

SKIP = 77
FETCH_SECONDS = 240  # all downloads together, on a cold cache

# (label, PyPI requirement, the library's name in the wheel): the CUDA
# runtimes whose lookups are compared; each in <cache>/cudart/.
RUNTIMES = [
    ("cudart", "nvidia-cuda-runtime-cu12", "libcudart.so.12"),
    ("cudart13", "nvidia-cuda-runtime>=13.0,<13.1", "libcudart.so.13"),
]

# (tag, Debian suite, CUDA package, NVML package, directory inside the package)
RELEASES = [
    ("470", "bookworm", "libnvidia-tesla-470-cuda1", "libnvidia-tesla-470-ml1", "nvidia/tesla-470"),
    ("535", "bookworm", "libcuda1", "libnvidia-ml1", "nvidia/current"),
    ("550", "trixie", "libcuda1", "libnvidia-ml1", "nvidia/current"),
    ("555", "experimental", "libcuda1", "libnvidia-ml1", "nvidia/current"),
]
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
LIBDIR = "usr/lib/x86_64-linux-gnu"


def skip(why):
    print(f"SKIPPED: {why}")
    sys.exit(SKIP)


def left(deadline):
    return max(1, int(deadline - time.monotonic()))


# ---------------------------------------------------------------------------
# Fetching
# ---------------------------------------------------------------------------

def debian_mirror():
    """The Debian archive this machine's apt already uses (read, never changed)."""
    if os.environ.get("FRACGPU_DEBIAN_MIRROR"):
        return os.environ["FRACGPU_DEBIAN_MIRROR"]
    codename = ""
    try:
        with open("/etc/os-release") as f:
            for line in f:
                if line.startswith("VERSION_CODENAME="):
                    codename = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        return None
    entries = []  # (uris, suites)
    paths = ["/etc/apt/sources.list"]
    if os.path.isdir("/etc/apt/sources.list.d"):
        paths += [os.path.join("/etc/apt/sources.list.d", n) for n in sorted(os.listdir("/etc/apt/sources.list.d"))]
    for path in paths:
        try:
            text = open(path).read()
        except OSError:
            continue
        if path.endswith(".sources"):
            for stanza in re.split(r"\n\s*\n", text):
                fields = {}
                for line in stanza.splitlines():
                    if ":" in line and not line.startswith("#"):
                        k, v = line.split(":", 1)
                        fields[k.strip().lower()] = v.split()
                entries.append((fields.get("uris", []), fields.get("suites", [])))
        elif path.endswith(".list"):
            for line in text.splitlines():
                line = re.sub(r"\[[^]]*\]", "", line).split()
                if len(line) >= 3 and line[0] == "deb":
                    entries.append(([line[1]], [line[2]]))
    for uris, suites in entries:
        if codename in suites:
            for uri in uris:
                if "security" not in uri:
                    return uri
    return None


def run(cmd, deadline, **kw):
    # apt's messages and `apt-cache policy` parsed in one language.
    env = dict(os.environ, LC_ALL="C")
    return subprocess.run(cmd, timeout=left(deadline), capture_output=True, text=True, env=env, **kw)


def release_dir(cache, tag):
    return os.path.join(cache, "releases", tag)


def have_release(cache, tag):
    d = release_dir(cache, tag)
    return os.path.exists(os.path.join(d, "cuda", "libcuda.so.1")) and \
        os.path.exists(os.path.join(d, "nvml", "libnvidia-ml.so.1"))


def fetch(cache):
    """Fills the cache; returns None, or why it could not."""
    deadline = time.monotonic() + FETCH_SECONDS
    missing = [r for r in RELEASES if not have_release(cache, r[0])]
    if missing:
        mirror = debian_mirror()
        if mirror is None:
            return "no Debian archive in this machine's apt configuration (set FRACGPU_DEBIAN_MIRROR)"
        if not os.path.exists(KEYRING) or shutil.which("apt-get") is None or shutil.which("dpkg") is None:
            return "apt-get, dpkg or the Debian archive keyring is missing"
        apt = os.path.join(cache, "apt")
        for sub in ("lists/partial", "cache/archives/partial", "debs"):
            os.makedirs(os.path.join(apt, sub), exist_ok=True)
        sources = os.path.join(apt, "sources.list")
        with open(sources, "w") as f:
            for suite in sorted({r[1] for r in missing}):
                f.write(f"deb [signed-by={KEYRING}] {mirror} {suite} non-free\n")
        opts = ["-o", f"Dir::Etc::sourcelist={sources}", "-o", "Dir::Etc::sourceparts=-",
                "-o", f"Dir::State::Lists={apt}/lists", "-o", f"Dir::Cache={apt}/cache",
                "-o", "Dir::State::status=/dev/null", "-o", "APT::Sandbox::User=root", "-q"]
        try:
            r = run(["apt-get", *opts, "update"], deadline)
            if r.returncode != 0:
                return "apt-get update failed: " + r.stderr.strip()[-400:]
            wanted = []
            for tag, suite, cuda, nvml, _ in missing:
                wanted += [f"{cuda}/{suite}", f"{nvml}/{suite}"]
            debs = os.path.join(apt, "debs")
            r = run(["apt-get", *opts, "download", *wanted], deadline, cwd=debs)
            if r.returncode != 0:
                return "apt-get download failed: " + r.stderr.strip()[-400:]
            for tag, suite, cuda, nvml, inner in missing:
                for pkg, kind in ((cuda, "cuda"), (nvml, "nvml")):
                    # The version apt chose for that suite is the newest file of the package.
                    files = sorted(f for f in os.listdir(debs) if f.startswith(pkg + "_"))
                    version = run(["apt-cache", *opts, "policy", pkg], deadline).stdout
                    chosen = pick_deb(files, pkg, suite, version)
                    if chosen is None:
                        return f"no {pkg} for {suite}"
                    x = tempfile.mkdtemp(dir=apt)
                    r = run(["dpkg", "-x", os.path.join(debs, chosen), x], deadline)
                    if r.returncode != 0:
                        return f"dpkg -x {chosen} failed"
                    out = os.path.join(release_dir(cache, tag), kind)
                    shutil.rmtree(out, ignore_errors=True)
                    shutil.copytree(os.path.join(x, LIBDIR, inner), out, symlinks=True)
                    with open(os.path.join(release_dir(cache, tag), kind + ".version"), "w") as f:
                        f.write(chosen + "\n")
                    shutil.rmtree(x, ignore_errors=True)
        except subprocess.TimeoutExpired:
            return f"downloads took more than {FETCH_SECONDS} s"
    for _, requirement, soname in RUNTIMES:
        why = fetch_runtime(cache, requirement, soname, deadline)
        if why is not None:
            return why
    return None


def runtime_path(cache, soname):
    return os.path.join(cache, "cudart", soname)


def fetch_runtime(cache, requirement, soname, deadline):
    """The CUDA runtime library `soname` from the PyPI wheel `requirement`,
    into the cache; None, or why it could not."""
    cudart = runtime_path(cache, soname)
    if os.path.exists(cudart):
        return None
    package = re.split(r"[<>=!~ ]", requirement, maxsplit=1)[0]
    wheels = os.path.join(cache, "wheels")
    os.makedirs(wheels, exist_ok=True)
    try:
        r = run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                 "--platform", "manylinux2014_x86_64", "--python-version", "3.11", "-q", "-d", wheels,
                 requirement], deadline)
    except subprocess.TimeoutExpired:
        return f"downloads took more than {FETCH_SECONDS} s"
    prefix = package.replace("-", "_") + "-"
    found = []
    for f in os.listdir(wheels):
        if not (f.startswith(prefix) and f.endswith(".whl")):
            continue
        with zipfile.ZipFile(os.path.join(wheels, f)) as z:
            if any(n.endswith("/" + soname) for n in z.namelist()):
                found.append(f)
    if r.returncode != 0 or not found:
        return f"pip download {requirement} failed: " + r.stderr.strip()[-400:]
    wheel = sorted(found)[-1]
    with zipfile.ZipFile(os.path.join(wheels, wheel)) as z:
        member = [n for n in z.namelist() if n.endswith("/" + soname)][0]
        os.makedirs(os.path.dirname(cudart), exist_ok=True)
        with open(cudart + ".part", "wb") as f:
            f.write(z.read(member))
        os.replace(cudart + ".part", cudart)
    with open(cudart + ".version", "w") as f:
        f.write(wheel + "\n")
    return None


def pick_deb(files, pkg, suite, policy):
    """The downloaded file of `pkg` that is the candidate of `suite`."""
    # apt-cache policy lists "version priority" lines followed by the
    # archives offering it; find the version offered by this suite.
    version = None
    current = None
    for line in policy.splitlines():
        m = re.match(r"\s*(?:\*\*\*)?\s*(\S+)\s+-?\d+\s*$", line)
        if m:
            current = m.group(1)
        elif current and re.search(rf"\s{re.escape(suite)}/non-free\s", line + " "):
            version = current
            break
    if version is None:
        return None
    want = f"{pkg}_{version.replace(':', '%3a')}_amd64.deb"
    return want if want in files else None


# ---------------------------------------------------------------------------
# Checking
# ---------------------------------------------------------------------------

def hooked_names(path, macro):
    pattern = re.compile(rf"^{macro}\(([A-Za-z0-9_]+),")
    return [m.group(1) for m in map(pattern.match, open(path)) if m]


def base_name(name):
    return re.sub(r"(_v\d+)?(_ptsz|_ptds)?$", "", name)


def exported(lib, prefix):
    out = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True, check=True).stdout
    return sorted({line.split()[-1] for line in out.splitlines() if line.split()[-1].startswith(prefix)})


def probe(args, env, timeout=300):
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {r.returncode}: {r.stderr[-2000:]}")
    return [line.split("\t") for line in r.stdout.splitlines() if line]


class Tally:
    def __init__(self):
        self.hooked = 0      # our hook of the driver's variant handed out
        self.passed = 0      # an unhooked entry point, untouched
        self.refused = 0     # refused by both
        self.failures = []

    def check(self, what, plain, pre, hooked):
        """plain/pre: probe lines without/with the interposer."""
        if plain[:6] != pre[:6]:
            self.failures.append(f"{what}: {plain} vs {pre}")
            return
        a, b = plain[6], pre[6]
        if a == "-":
            if b != "-":
                self.failures.append(f"{what}: the driver refuses, the interposer hands out {b}: {plain}")
            else:
                self.refused += 1
            return
        lib, _, sym = a.partition(":")
        base = base_name(plain[1]) if plain[0] not in ("dlsym", "entry") else plain[1]
        if lib == "libcuda" or lib == "libnvidia-ml":
            if sym in hooked:
                if b != f"libfracgpu.so:{sym}":
                    self.failures.append(f"{what}: the driver returns {a}, the interposer hands out {b}: {plain}")
                else:
                    self.hooked += 1
                return
            if plain[0] not in ("dlsym", "entry") and base_name(base) in {base_name(h) for h in hooked}:
                # A variant of a hooked function that fracgpu does not hook.
                self.failures.append(f"{what}: the driver returns {a}, a variant of a hooked function that "
                                     f"fracgpu does not hook (passed through unenforced): {plain}")
                return
        if b != a:
            self.failures.append(f"{what}: not hooked, but {a} became {b}: {plain}")
        else:
            self.passed += 1


def compare(what, plain, pre, hooked, tally):
    if len(plain) != len(pre):
        tally.failures.append(f"{what}: {len(plain)} answers without the interposer, {len(pre)} with it")
        return
    for a, b in zip(plain, pre):
        if a[0] in ("cuInit", "cudaGetDeviceCount"):
            if a[4] != b[4]:
                tally.failures.append(f"{what}: {a[0]} answered {a[4]} without the interposer, {b[4]} with it")
            continue
        tally.check(what, a, b, hooked)


# The report's paths a row of the documentation's matrix stands for, by the
# row's "lookup path" text: several paths where the doc gives one count for
# each of them.
MATRIX_PATHS = [
    ("`cuGetProcAddress`, `_v2`", ("v1", "v2", "v2-nostatus")),
    ("`cuGetProcAddress`", ("v1",)),
    ("`dlsym` (CUDA)", ("dlsym",)),
    ("`dlsym` (NVML)", ("nvml dlsym",)),
    ("CUDA 12 runtime", ("cudart lookups",)),
    ("CUDA 13.0 runtime", ("cudart13 lookups",)),
]


def stale_matrix_rows(doc, rows):
    """What in the doc's matrix ("## Matrix (last run)") disagrees with this
    run, for the releases it names at the version fetched here (a release
    Debian has moved on from is said, not failed: its counts may differ)."""
    problems = []
    fetched = {}
    for tag, suite, version, init, runtimes, tallies in rows:
        m = re.search(r"_(\d+\.\d+(?:\.\d+)?)-", version)
        fetched["simulated" if tag == "sim" else (m.group(1) if m else version)] = (tag, tallies, runtimes)
    in_matrix = False
    doc_releases = set()
    for n, line in enumerate(open(doc).read().splitlines(), 1):
        if line.startswith("## "):
            in_matrix = line.startswith("## Matrix")
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if in_matrix and line.startswith("|") else []
        if len(cells) != 5 or not cells[2].isdigit():
            continue
        release, path_text, counts = cells[0], cells[1], tuple(int(c) for c in cells[2:5])
        doc_releases.add(release)
        if release not in fetched:
            continue
        paths = next((p for prefix, p in MATRIX_PATHS if path_text.startswith(prefix)), None)
        if paths is None:
            problems.append(f"{doc}:{n}: matrix row for {release}: unknown lookup path {path_text!r}")
            continue
        tag, tallies, runtimes = fetched[release]
        # A runtime row names how many lookups its runtime made: a runtime of
        # another release (pip fetches the newest) is noted, not compared.
        made = re.search(r"\+ (\d+) lookups", path_text)
        soname = {"cudart lookups": "libcudart.so.12", "cudart13 lookups": "libcudart.so.13"}.get(paths[0])
        made_here = runtimes.get(soname, (None, None))[1]
        if made and soname and made_here != int(made.group(1)) + 1:
            print(f"NOTE: {doc}:{n}: the matrix's {path_text} is of another runtime than this run's "
                  f"({soname}: {made_here if made_here is not None else 'no'} lookups): not compared")
            continue
        for path in paths:
            t = tallies.get(path)
            got = (t.hooked, t.passed, t.refused) if t else None
            if got != counts:
                problems.append(f"{doc}:{n}: the matrix says {counts} (hook, untouched, refused) for {release} "
                                f"{path_text}, this run found {got} ({tag} {path}): update the matrix")
    for release in sorted(set(fetched) - doc_releases):
        print(f"NOTE: {doc}'s matrix has no rows for {release} (fetched here): not compared")
    return problems


def main():
    ap = argparse.ArgumentParser()
    for name in ("--probe", "--recorder", "--interposer", "--hooks", "--nvml-hooks"):
        ap.add_argument(name, required=True)
    # The simulated driver and NVML stand-in: checked first, always (they
    # answer for CUDA 13.0, which no release fetched here does).
    ap.add_argument("--sim-cuda")
    ap.add_argument("--sim-nvml")
    ap.add_argument("--report")
    # docs/compatibility.md: its matrix must carry this run's counts for
    # every release it names (fetched here at that very version).
    ap.add_argument("--doc")
    args = ap.parse_args()
    cache = os.environ.get("FRACGPU_CONFORMANCE_CACHE") or os.path.expanduser("~/.cache/fracgpu-conformance")
    os.makedirs(cache, exist_ok=True)
    # Runs from two build trees may share the cache: one fills it at a time.
    with open(os.path.join(cache, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        why = fetch(cache)

    cuda_hooked = set(hooked_names(args.hooks, "FRACGPU_HOOK"))
    nvml_hooked = set(hooked_names(args.nvml_hooks, "FRACGPU_NVML_HOOK"))
    cuda_bases = {base_name(n) for n in cuda_hooked}
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("LD_", "FRACGPU_", "SIMCUDA_"))}
    # No tenant: the interposer runs in passthrough mode; lookups are mapped
    # all the same (they must be, before any tenant is known).
    base_env["FRACGPU_TENANT_DIR"] = os.path.join(cache, "no-such-tenant")
    rows = []
    failed = False
    releases = []
    if args.sim_cuda and args.sim_nvml:
        releases.append(("sim", "-", "simulated driver (tests/simcuda)", args.sim_cuda, args.sim_nvml))
    if why is None:
        for tag, suite, _, _, _ in RELEASES:
            d = release_dir(cache, tag)
            releases.append((tag, suite, open(os.path.join(d, "cuda.version")).read().strip(),
                             os.path.join(d, "cuda"), os.path.join(d, "nvml")))
    with tempfile.TemporaryDirectory() as tmp:
        for tag, suite, version, cuda_dir, nvml_dir in releases:
            libcuda = os.path.join(cuda_dir, "libcuda.so.1")
            names = exported(libcuda, "cu")
            lookups = sorted({base_name(n) for n in names} | cuda_bases | set(names) & cuda_hooked | cuda_hooked)
            names_file = os.path.join(tmp, f"names-{tag}")
            with open(names_file, "w") as f:
                for n in lookups:
                    hooked_base = base_name(n) in cuda_bases
                    f.write(n + ("" if hooked_base else " few") + "\n")
            env = dict(base_env, LD_LIBRARY_PATH=cuda_dir + ":" + nvml_dir)
            pre_env = dict(env, LD_PRELOAD=args.interposer)
            tallies = {}
            plain = probe([args.probe, "cuda", names_file], env)
            pre = probe([args.probe, "cuda", names_file], pre_env)
            by_path = {}
            for a, b in zip(plain, pre):
                by_path.setdefault(a[0], ([], []))
                by_path[a[0]][0].append(a)
                by_path[a[0]][1].append(b)
            if len(plain) != len(pre):
                t = tallies.setdefault("cuda", Tally())
                t.failures.append(f"{len(plain)} answers without the interposer, {len(pre)} with it")
            for path, (pa, pb) in by_path.items():
                if path == "cuInit":
                    continue
                compare(f"{tag} {path}", pa, pb, cuda_hooked, tallies.setdefault(path, Tally()))
            init = [a for a in plain if a[0] == "cuInit"]
            # NVML: dlsym of every export and every hooked name.
            libnvml = os.path.join(nvml_dir, "libnvidia-ml.so.1")
            nvml_names = sorted(set(exported(libnvml, "nvml")) | nvml_hooked)
            nvml_file = os.path.join(tmp, f"nvml-{tag}")
            with open(nvml_file, "w") as f:
                f.write("\n".join(nvml_names) + "\n")
            compare(f"{tag} nvml", probe([args.probe, "nvml", nvml_file], env),
                    probe([args.probe, "nvml", nvml_file], pre_env), nvml_hooked, tallies.setdefault("nvml dlsym", Tally()))
            # The CUDA runtimes as the client (when they could be fetched: only
            # the simulated driver runs without them, and the test is then
            # skipped).
            runtimes = {}
            for label, _, soname in RUNTIMES:
                cudart = runtime_path(cache, soname)
                records = [([["cudaGetDeviceCount", "-", "-", "-", "not fetched"]], []),
                           ([["cudaGetDeviceCount", "-", "-", "-", "not fetched"]], [])]
                for i, e in enumerate((env, pre_env) if os.path.exists(cudart) else ()):
                    rec = os.path.join(tmp, f"record-{tag}-{label}-{i}")
                    e = dict(e, CONFORMANCE_RECORD=rec)
                    e["LD_PRELOAD"] = args.recorder + (":" + args.interposer if i == 1 else "")
                    out = probe([args.probe, "cudart", cudart], e)
                    lines = [line.split("\t") for line in open(rec).read().splitlines()] if os.path.exists(rec) else []
                    records[i] = (out, lines)
                compare(f"{tag} {label}", records[0][1], records[1][1], cuda_hooked,
                        tallies.setdefault(f"{label} lookups", Tally()))
                runtimes[soname] = (records[0][0][0][4], len(records[0][1]))
            rows.append((tag, suite, version, init[0][4] if init else "?", runtimes, tallies))
            for t in tallies.values():
                failed |= bool(t.failures)

    report = ["| release | package | path | hook handed out | passed untouched | refused by both | mismatches |",
              "|---|---|---|---|---|---|---|"]
    for tag, suite, version, init, runtimes, tallies in rows:
        for path, t in sorted(tallies.items()):
            report.append(f"| {tag} | {version} ({suite}) | {path} | {t.hooked} | {t.passed} | {t.refused} | "
                          f"{len(t.failures)} |")
    report.append("")
    for tag, suite, version, init, runtimes, tallies in rows:
        made = "; ".join(f"{soname} made {n} lookups (cudaGetDeviceCount answered {rt})"
                         for soname, (rt, n) in runtimes.items())
        report.append(f"- {tag}: cuInit without a GPU answered {init}; {made}")
    text = "\n".join(report)
    print(text)
    if args.report:
        with open(args.report, "w") as f:
            f.write(text + "\n")
    for tag, suite, version, init, runtimes, tallies in rows:
        for path, t in sorted(tallies.items()):
            for failure in t.failures[:20]:
                print(f"FAIL {failure}")
            if len(t.failures) > 20:
                print(f"FAIL ... and {len(t.failures) - 20} more in {tag} {path}")
    if args.doc:
        for problem in stale_matrix_rows(args.doc, rows):
            print(f"FAIL {problem}")
            failed = True
    if failed:
        return 1
    if why is not None:
        skip(f"the driver packages could not be fetched into {cache}: {why} (the simulated driver passed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
