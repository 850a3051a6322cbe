#!/usr/bin/env python3
"""Checks the Kubernetes manifests under deploy/ (docs/kubernetes.md).

Two checks, chosen by the options:

--schemas (test k8s_manifests): every manifest under deploy/ against the
  Kubernetes 1.36 schemas (kubernetes-validate, strict: unknown fields are
  errors), and what the schemas cannot see: quantities that do not parse, the
  install's parts agreeing with each other (service account, role, binding,
  admission policy, DaemonSet, ConfigMap, DeviceClass), the plugin's paths
  mounted where they are on the host, privileges only where the DaemonSet
  says they are needed, the interposer installed by a rename, claims that
  name the class and capacities fracgpu publishes. With --fracgpud it also
  runs the fracgpud container's start script (fake nvidia-smi, simulated
  driver) and has `fracgpud --check` judge the node config it writes. Then
  it breaks copies of the manifests in known ways and fails unless each
  breakage is reported (a check that cannot fail checks nothing).

--slice-builder (test k8s_examples_request_policy): builds the ResourceSlice
  the plugin would publish for a node (the plugin's own code,
  tests/k8s_manifests/slice_dump.cpp, from the control API's NODE object in
  --node), validates it against the 1.36 schema and the API server's rules
  for a requestPolicy, and books every example's claims on it the way the
  1.36 kube-scheduler does: each must fit, and must be booked exactly as
  asked, not rounded up by the policy (a claim for 500m booked as 1 would
  hold the whole GPU).

Exit 77 (skipped) when kubernetes-validate cannot be imported, saying why.

Usage: check_manifests.py --source DIR --schemas [--fracgpud PATH --simcuda DIR]
       check_manifests.py --source DIR --slice-builder PATH --node FILE
"""
import argparse
import copy
import fractions
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

# Where scripts/install-deps.sh puts kubernetes-validate when the system's
# Python is externally managed (PEP 668): first, so that its own jsonschema
# is the one it imports.
KUBERNETES_VALIDATE_DIR = "/usr/local/lib/fracgpu-tests/python"
if os.path.isdir(KUBERNETES_VALIDATE_DIR):
    sys.path.insert(0, KUBERNETES_VALIDATE_DIR)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import check_recipes  # noqa: E402  (tests/check_recipes.py: the interposer's install by rename)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "kube"))
import fake_scheduler  # noqa: E402  (tests/kube/fake_scheduler.py: the scheduler's claim for extended resources)

SKIP = 77
KUBERNETES_VERSION = "1.36.0"
DRIVER = "gpu.fracgpu.io"
CONFIG_API_VERSION = "gpu.fracgpu.io/v1alpha1"
CONFIG_KIND = "GpuConfig"
# The capacities each published device has (controller/kube/resource_slice.h).
CAPACITIES = ("memory", "share")
PLUGIN_BINARY = "/usr/bin/fracgpu-kubelet-plugin"
# The plugin's path flags that name host directories the kubelet, the
# container runtime or fracgpud must find at the same path (k8s contract).
PLUGIN_HOST_DIRS = ("--plugin-dir", "--registry-dir", "--cdi-dir", "--run-dir")
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# The only container allowed to be privileged, and why (daemonset.yaml).
PRIVILEGED_CONTAINER = "fracgpud"
# Exactly what the plugin may do (rbac.yaml).
PLUGIN_RULES = {("resource.k8s.io", "resourceclaims"): {"get"},
                # status.devices, by server-side apply; from 1.36 also the
                # driver's own entries on claims of its node (granular authorization)
                ("resource.k8s.io", "resourceclaims/status"): {"patch"},
                ("resource.k8s.io", "resourceclaims/driver"): {"associated-node:patch"},
                ("resource.k8s.io", "resourceslices"): {"get", "list", "create", "update", "delete"},
                ("", "nodes"): {"get"}}  # its own node's uid, for the slice's owner reference


class Report:
    def __init__(self):
        self.errors = []

    def fail(self, where, message):
        self.errors.append(f"{where}: {message}")


# ---- Quantities, as resource.Quantity parses and rounds them ----

QUANTITY = re.compile(r"^([+-]?)(\d+(?:\.\d*)?|\.\d+)(?:(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])|[eE]([+-]?\d+))?$")
BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def parse_quantity(text):
    """The exact value of a Kubernetes quantity (a Fraction), or None."""
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        return None
    match = QUANTITY.match(str(text))
    if not match:
        return None
    sign, number, suffix, exponent = match.groups()
    value = fractions.Fraction(number)
    if suffix in BINARY:
        value *= BINARY[suffix]
    elif exponent is not None:
        value *= fractions.Fraction(10) ** int(exponent)
    else:
        value *= fractions.Fraction(10) ** DECIMAL[suffix or ""]
    return -value if sign == "-" else value


def value_of(q):
    """Quantity.Value(): rounded up to a whole unit."""
    return math.ceil(q)


def show(q):
    """A quantity for messages: 20Gi, 500m, 1."""
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        if q >= BINARY[suffix] and q % BINARY[suffix] == 0:
            return f"{q // BINARY[suffix]}{suffix}"
    if q.denominator == 1:
        return str(q.numerator)
    milli = q * 1000
    return f"{milli.numerator}m" if milli.denominator == 1 else str(float(q))


# ---- Loading ----

def load(source):
    """(path relative to source, document) for every YAML document under deploy/."""
    docs = []
    for path in sorted((source / "deploy").rglob("*.yaml")):
        rel = path.relative_to(source)
        try:
            for doc in yaml.safe_load_all(path.read_text()):
                if doc is not None:
                    docs.append((str(rel), doc))
        except yaml.YAMLError as e:
            docs.append((str(rel), {"__error__": str(e)}))
    return docs


def name_of(doc):
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


# ---- Schemas ----

def validate_schemas(docs, report):
    import kubernetes_validate.utils as kv
    for where, doc in docs:
        if "__error__" in doc:
            report.fail(where, f"does not parse: {doc['__error__']}")
            continue
        if doc.get("kind") == "Kustomization":
            continue  # no schema in the API: checked by check_kustomization
        try:
            kv.validate(doc, KUBERNETES_VERSION, strict=True)
        except kv.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            report.fail(where, f"{name_of(doc)} is not valid Kubernetes {KUBERNETES_VERSION}: {path}: {e.message}")
        except kv.SchemaNotFoundError as e:
            report.fail(where, f"{name_of(doc)}: {e.message}")


# ---- The install (deploy/*.yaml) ----

def check_kustomization(source, docs, report):
    kustomizations = [(w, d) for w, d in docs if d.get("kind") == "Kustomization" and "/" not in w[len("deploy/"):]]
    if not kustomizations:
        report.fail("deploy/", "no kustomization.yaml: the install is `kubectl apply -k deploy/`")
        return
    where, kustomization = kustomizations[0]
    if "namespace" in kustomization:
        report.fail(where, "sets a namespace: the admission policy's user name would no longer name the "
                           "plugin's service account (set the namespace in the manifests and the policy together)")
    listed = set(kustomization.get("resources", []))
    for resource in sorted(listed):
        if not (source / "deploy" / resource).is_file():
            report.fail(where, f"resource {resource} does not exist")
    present = {w[len("deploy/"):] for w, d in docs if "/" not in w[len("deploy/"):]} - {"kustomization.yaml"}
    for missing in sorted(present - listed):
        report.fail(where, f"deploy/{missing} is not among its resources: `kubectl apply -k deploy/` would leave it out")


def check_kustomize_build(source, docs, report):
    """Where kubectl is at hand, kustomize itself builds the install: the
    same objects as the files hold."""
    where = "deploy/kustomization.yaml"
    if shutil.which("kubectl") is None:
        print("note: kubectl not found: the kustomization is checked by its resource list only")
        return
    result = subprocess.run(["kubectl", "kustomize", str(source / "deploy")], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        report.fail(where, f"kubectl kustomize fails: {result.stderr.strip()}")
        return
    built = sorted(name_of(d) for d in yaml.safe_load_all(result.stdout) if d)
    expected = sorted(name_of(d) for w, d in install_docs(docs))
    if built != expected:
        report.fail(where, f"kubectl kustomize builds {built}, not the files' {expected}")


def install_docs(docs):
    return [(w, d) for w, d in docs if w.count("/") == 1 and d.get("kind") != "Kustomization"]


def one(docs, kind, report, where="deploy/"):
    found = [(w, d) for w, d in docs if d.get("kind") == kind]
    if len(found) != 1:
        report.fail(where, f"expected one {kind}, found {len(found)}")
        return None, None
    return found[0]


def check_install(docs, report):
    docs = install_docs(docs)
    _, namespace = one(docs, "Namespace", report)
    namespace = namespace["metadata"]["name"] if namespace else None
    for where, d in docs:
        ns = d.get("metadata", {}).get("namespace")
        if d.get("kind") in ("ServiceAccount", "ConfigMap", "DaemonSet") and ns != namespace:
            report.fail(where, f"{name_of(d)} is in namespace {ns!r}, not the install's {namespace!r}")

    sa_where, sa = one(docs, "ServiceAccount", report)
    role_where, role = one(docs, "ClusterRole", report)
    binding_where, binding = one(docs, "ClusterRoleBinding", report)
    ds_where, ds = one(docs, "DaemonSet", report)
    if not (sa and role and binding and ds):
        return
    account = (sa["metadata"].get("namespace"), sa["metadata"]["name"])

    # The role: exactly the plugin's verbs.
    granted = {}
    for rule in role.get("rules", []):
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                granted.setdefault((group, resource), set()).update(rule.get("verbs", []))
    for rule in role.get("rules", []):
        if "resourceclaims/driver" in rule.get("resources", []) and rule.get("resourceNames") != [DRIVER]:
            report.fail(role_where, f"resourceclaims/driver is granted for {rule.get('resourceNames')}, "
                                    f"not for the driver's name alone ([{DRIVER}])")
    if granted != PLUGIN_RULES:
        report.fail(role_where, f"ClusterRole grants {sorted((k, sorted(v)) for k, v in granted.items())}, "
                                f"not exactly what the plugin needs: {sorted((k, sorted(v)) for k, v in PLUGIN_RULES.items())}")
    if binding["roleRef"].get("name") != role["metadata"]["name"] or binding["roleRef"].get("kind") != "ClusterRole":
        report.fail(binding_where, f"binds {binding['roleRef']}, not ClusterRole {role['metadata']['name']}")
    subjects = {(s.get("namespace"), s.get("name")) for s in binding.get("subjects", []) if s.get("kind") == "ServiceAccount"}
    if subjects != {account}:
        report.fail(binding_where, f"binds service accounts {sorted(subjects)}, not the plugin's {account}")

    # The admission policy must name that same account, or it never applies.
    user = f"system:serviceaccount:{account[0]}:{account[1]}"
    policies = [(w, d) for w, d in docs if d.get("kind") == "ValidatingAdmissionPolicy"]
    if not policies:
        report.fail("deploy/", "no ValidatingAdmissionPolicy limiting the plugin's slice writes to its own node")
    for where, policy in policies:
        spec = policy["spec"]
        conditions = " ".join(c.get("expression", "") for c in spec.get("matchConditions", []))
        if f'"{user}"' not in conditions and f"'{user}'" not in conditions:
            report.fail(where, f"{name_of(policy)} does not match requests of the plugin's service account "
                               f"({user}): it would never apply")
        rules = spec.get("matchConstraints", {}).get("resourceRules", [])
        covered = {op for r in rules if "resourceslices" in r.get("resources", [])
                   and "resource.k8s.io" in r.get("apiGroups", []) for op in r.get("operations", [])}
        if not {"CREATE", "UPDATE", "DELETE"} <= covered:
            report.fail(where, f"{name_of(policy)} judges ResourceSlice operations {sorted(covered)}, "
                               "not all of CREATE, UPDATE, DELETE")
        text = json.dumps(spec)
        for needed in ("authentication.kubernetes.io/node-name", "nodeName", DRIVER):
            if needed not in text:
                report.fail(where, f"{name_of(policy)} does not compare {needed}")
        bound = [d for _, d in docs if d.get("kind") == "ValidatingAdmissionPolicyBinding"
                 and d["spec"].get("policyName") == policy["metadata"]["name"]]
        if not any("Deny" in b["spec"].get("validationActions", []) for b in bound):
            report.fail(where, f"{name_of(policy)} has no binding that denies")

    # The DeviceClass users name.
    class_where, device_class = one(docs, "DeviceClass", report)
    if device_class:
        if device_class["metadata"]["name"] != DRIVER:
            report.fail(class_where, f"the DeviceClass is {device_class['metadata']['name']}, not {DRIVER}")
        expressions = [s.get("cel", {}).get("expression", "") for s in device_class["spec"].get("selectors", [])]
        if not any(re.search(r'device\.driver\s*==\s*["\']' + re.escape(DRIVER) + r'["\']', e) for e in expressions):
            report.fail(class_where, f"no selector device.driver == \"{DRIVER}\"")
        for i, config in enumerate(device_class["spec"].get("config", [])):
            check_gpu_config(f"{class_where}: config[{i}]", config, None, report)

    check_daemonset(ds_where, ds, account, docs, report)


def check_gpu_config(where, config, shares, report):
    """An opaque config for gpu.fracgpu.io: a GpuConfig whose limit the
    control API accepts ("share", or a fraction in (0, 1] no smaller than the
    shares it applies to) and whose priority, if any, is one the plugin takes."""
    opaque = config.get("opaque")
    if not opaque or opaque.get("driver") != DRIVER:
        return  # another driver's: not ours to judge
    parameters = opaque.get("parameters") or {}
    if parameters.get("apiVersion") != CONFIG_API_VERSION or parameters.get("kind") != CONFIG_KIND:
        report.fail(where, f"parameters are {parameters.get('apiVersion')}/{parameters.get('kind')}, "
                           f"not {CONFIG_API_VERSION}/{CONFIG_KIND}")
    unknown = set(parameters) - {"apiVersion", "kind", "limit", "priority"}
    if unknown:
        report.fail(where, f"unknown GpuConfig fields {sorted(unknown)}")
    if "priority" in parameters and parameters["priority"] not in ("latency", "normal", "batch"):
        report.fail(where, f"priority {parameters['priority']!r} is not \"latency\", \"normal\" or \"batch\"")
    if "limit" not in parameters:
        return
    limit = parameters["limit"]
    if limit == "share":
        return
    value = None
    if isinstance(limit, str) and re.fullmatch(r"\d+(\.\d+)?|\.\d+", limit):
        value = fractions.Fraction(limit)
    if value is None or not 0 < value <= 1:
        report.fail(where, f"limit {limit!r} is neither \"share\" nor a fraction of the GPU in (0, 1] written as a string")
        return
    for share in shares or []:
        if share is not None and value < share:
            report.fail(where, f"limit {limit} is below the share {show(share)} it applies to")


def flags(command):
    """--name=value and --name value of a command line, as a dict."""
    found, i = {}, 0
    while i < len(command):
        word = command[i]
        if word.startswith("--"):
            if "=" in word:
                name, value = word.split("=", 1)
            elif i + 1 < len(command) and not command[i + 1].startswith("--"):
                name, value = word, command[i + 1]
                i += 1
            else:
                name, value = word, ""
            found[name] = value
        i += 1
    return found


def check_daemonset(where, ds, account, docs, report):
    template = ds["spec"]["template"]
    pod = template["spec"]
    if ds["spec"]["selector"].get("matchLabels", {}).items() - template["metadata"].get("labels", {}).items():
        report.fail(where, "the DaemonSet's selector does not match its pod template")
    if pod.get("serviceAccountName") != account[1]:
        report.fail(where, f"runs as service account {pod.get('serviceAccountName')}, not {account[1]}")
    if pod.get("automountServiceAccountToken") is not False:
        report.fail(where, "the pod automounts the service account's token into every container: "
                           "mount it into the kubelet plugin's alone")
    if pod.get("hostNetwork"):
        report.fail(where, "hostNetwork: nothing in the pod needs the node's network")
    if not pod.get("hostPID"):
        report.fail(where, "no hostPID: fracgpud finds tenant processes by the host PIDs NVML reports")
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    containers = {c["name"]: c for c in pod.get("containers", [])}
    everything = check_recipes.walk_containers(pod)

    for c in everything:
        context = c.get("securityContext", {})
        c_where = f"{where}: container {c['name']}"
        for m in c.get("volumeMounts", []):
            if m["name"] not in volumes:
                report.fail(c_where, f"mounts undefined volume {m['name']}")
        if c["name"] == PRIVILEGED_CONTAINER:
            continue
        if context.get("privileged"):
            report.fail(c_where, f"is privileged: only {PRIVILEGED_CONTAINER} needs to be")
        if context.get("allowPrivilegeEscalation") is not False:
            report.fail(c_where, "does not set allowPrivilegeEscalation: false")
        if "ALL" not in context.get("capabilities", {}).get("drop", []) or context.get("capabilities", {}).get("add"):
            report.fail(c_where, "does not drop all capabilities (it needs none)")
        for m in c.get("volumeMounts", []):
            if m["mountPath"].rstrip("/") == TOKEN_DIR and c["name"] != "kubelet-plugin":
                report.fail(c_where, "gets the service account's token: only the kubelet plugin talks to the API server")

    plugin = containers.get("kubelet-plugin")
    daemon = containers.get("fracgpud")
    if plugin is None or daemon is None:
        report.fail(where, f"containers are {sorted(containers)}, not fracgpud and kubelet-plugin")
        return
    command = list(plugin.get("command", [])) + list(plugin.get("args", []))
    p_where = f"{where}: container kubelet-plugin"
    if not command or command[0] != PLUGIN_BINARY:
        report.fail(p_where, f"runs {command[:1]}, not {PLUGIN_BINARY}")
    options = flags(command[1:])
    env = {e["name"]: e for e in plugin.get("env", [])}
    if env.get("NODE_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "spec.nodeName":
        report.fail(p_where, "NODE_NAME is not the pod's spec.nodeName (downward API)")
    if options.get("--node-name", "$(NODE_NAME)") != "$(NODE_NAME)":
        report.fail(p_where, f"--node-name is {options['--node-name']}, not $(NODE_NAME)")
    mounts = check_recipes.host_mounts(pod, plugin)
    for flag in PLUGIN_HOST_DIRS:
        path = options.get(flag)
        if not path:
            report.fail(p_where, f"{flag} is not given: the manifests should not depend on the plugin's defaults")
            continue
        if mounts.get(path.rstrip("/")) != path.rstrip("/"):
            report.fail(p_where, f"{flag} {path} is not a hostPath volume mounted at the same path "
                                 f"(the kubelet and the container runtime use the host's path): mounts {mounts}")
    token = [m for m in plugin.get("volumeMounts", []) if m["mountPath"].rstrip("/") == TOKEN_DIR]
    if not token or "projected" not in volumes.get(token[0]["name"], {}):
        report.fail(p_where, f"no projected service-account token at {TOKEN_DIR}")

    # The interposer: installed by the init container, by a rename, where the
    # CDI specs mount it from.
    library = options.get("--library-host-path")
    if not library or not options.get("--library-container-path", "").startswith("/"):
        report.fail(p_where, "--library-host-path and --library-container-path must both be given, as absolute paths")
    else:
        installs = []
        check_recipes.errors.clear()
        for c in pod.get("initContainers", []):
            check_recipes.check_library_writes(f"{where}: container {c['name']}", pod, c, installs, library=library)
        for c in pod.get("containers", []):
            check_recipes.check_library_writes(f"{where}: container {c['name']}", pod, c, [], library=library)
        report.errors += check_recipes.errors
        check_recipes.errors.clear()
        if not installs:
            report.fail(where, f"no init container installs {library} by a rename from the same directory "
                               "(--library-host-path: where the CDI specs mount the interposer from)")

    # fracgpud: its run dir is the plugin's, on the host; its liveness probe
    # asks the port the ConfigMap's metrics_address listens on.
    d_where = f"{where}: container fracgpud"
    daemon_mounts = check_recipes.host_mounts(pod, daemon)
    config_map = next((d for _, d in docs if d.get("kind") == "ConfigMap"), None)
    toml = (config_map or {}).get("data", {}).get("fracgpud.toml", "")
    run_dir = (re.findall(r'^\s*run_dir\s*=\s*"([^"]+)"', toml, re.M) or ["/run/fracgpu"])[0]
    if daemon_mounts.get(run_dir) != run_dir or options.get("--run-dir") != run_dir:
        report.fail(d_where, f"the daemon's run dir {run_dir} is not the host's {run_dir} in both containers "
                             f"(fracgpud mounts {daemon_mounts}, the plugin's --run-dir is {options.get('--run-dir')})")
    if re.search(r"^\s*\[\[tenant\]\]", toml, re.M):
        report.fail(d_where, "the ConfigMap has config tenants: on a DRA node every tenant comes from a claim")
    address = re.findall(r'^\s*metrics_address\s*=\s*"([^"]*)"', toml, re.M)
    port = re.findall(r":(\d+)$", address[0]) if address else []
    probe = daemon.get("livenessProbe", {}).get("httpGet", {})
    ports = {p.get("name"): p.get("containerPort") for p in daemon.get("ports", [])}
    probe_port = ports.get(probe.get("port"), probe.get("port"))
    if probe.get("path") != "/healthz" or not port or str(probe_port) != port[0]:
        report.fail(d_where, f"the liveness probe asks {probe.get('path')} on port {probe_port}, not /healthz on "
                             f"the metrics port of the ConfigMap's metrics_address {address}")


# ---- Claims (deploy/examples/) ----

def pod_specs(doc):
    kind = doc.get("kind")
    if kind == "Pod":
        return [doc["spec"]]
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        return [doc["spec"]["template"]["spec"]]
    return []


def claim_specs(docs):
    """(where, name, claim spec) of every ResourceClaim and ResourceClaimTemplate."""
    found = []
    for where, d in docs:
        if d.get("kind") == "ResourceClaimTemplate":
            found.append((where, d["metadata"]["name"], d["spec"]["spec"]))
        elif d.get("kind") == "ResourceClaim":
            found.append((where, d["metadata"]["name"], d["spec"]))
    return found


def requests_of(claim):
    """(name, exact request) for each request and subrequest."""
    out = []
    for r in claim.get("devices", {}).get("requests", []):
        if "exactly" in r:
            out.append((r["name"], r["exactly"]))
        for sub in r.get("firstAvailable", []):
            out.append((f"{r['name']}/{sub['name']}", sub))
    return out


def requested(request):
    """{capacity name: Fraction or None (unparseable)} a request asks for."""
    return {name: parse_quantity(q) for name, q in (request.get("capacity") or {}).get("requests", {}).items()}


def check_examples(docs, report):
    examples = [(w, d) for w, d in docs if w.startswith("deploy/examples/")]
    if not examples:
        report.fail("deploy/examples/", "no examples")
        return
    templates = {name for _, name, _ in claim_specs(examples)}
    for where, name, claim in claim_specs(examples):
        c_where = f"{where}: claim {name}"
        shares = {}
        for request_name, request in requests_of(claim):
            r_where = f"{c_where}: request {request_name}"
            if request.get("deviceClassName") != DRIVER:
                report.fail(r_where, f"asks class {request.get('deviceClassName')}, not {DRIVER}")
            asked = requested(request)
            for capacity, value in asked.items():
                if capacity not in CAPACITIES:
                    report.fail(r_where, f"asks for capacity {capacity!r}: fracgpu publishes {', '.join(CAPACITIES)}")
                elif value is None:
                    raw = request["capacity"]["requests"][capacity]
                    report.fail(r_where, f"{capacity}: {raw!r} is not a Kubernetes quantity (e.g. 20Gi, 500m)")
                elif value <= 0:
                    report.fail(r_where, f"{capacity}: {show(value)} is not above 0")
            if asked and set(asked) != set(CAPACITIES):
                missing = sorted(set(CAPACITIES) - set(asked))
                report.fail(r_where, f"asks for {', '.join(sorted(asked))} but not {', '.join(missing)}: a capacity "
                                     "left out is booked at its default, the whole GPU's")
            if asked.get("share") is not None and asked["share"] > 1:
                report.fail(r_where, f"share {show(asked['share'])} is above one GPU")
            shares[request_name] = asked.get("share", fractions.Fraction(1))
        for i, config in enumerate(claim.get("devices", {}).get("config", [])):
            applies = config.get("requests") or list(shares)
            check_gpu_config(f"{c_where}: config[{i}]", config, [shares.get(r) for r in applies], report)
        for i, constraint in enumerate(claim.get("devices", {}).get("constraints", [])):
            for key in ("matchAttribute", "distinctAttribute"):
                attribute = constraint.get(key)
                if attribute and not attribute.startswith(DRIVER + "/"):
                    report.fail(f"{c_where}: constraints[{i}]", f"{key} {attribute} is not one of {DRIVER}'s attributes")
    classes = [d for w, d in install_docs(docs) if d.get("kind") == "DeviceClass"]
    mapped = fake_scheduler.class_mapping(classes)
    for where, d in examples:
        for pod in pod_specs(d):
            p_where = f"{where}: {name_of(d)}"
            # Old-style requests: each extended resource must be one a
            # DeviceClass of the install stands for, a whole number.
            for i, c in enumerate(check_recipes.walk_containers(pod)):
                try:
                    asked = fake_scheduler.container_requests(c, f"container {c['name']}")
                except fake_scheduler.Invalid as e:
                    report.fail(p_where, str(e))
                    continue
                for resource in asked:
                    if resource not in mapped:
                        report.fail(p_where, f"container {c['name']} asks for {resource}, which no DeviceClass of "
                                             f"deploy/ stands for (they stand for {sorted(mapped)})")
            declared = {}
            for rc in pod.get("resourceClaims", []):
                declared[rc["name"]] = rc
                template = rc.get("resourceClaimTemplateName")
                if template and template not in templates:
                    report.fail(p_where, f"resourceClaims {rc['name']}: template {template} is not among the examples")
            for c in check_recipes.walk_containers(pod):
                for claim in (c.get("resources") or {}).get("claims", []):
                    if claim["name"] not in declared:
                        report.fail(p_where, f"container {c['name']} uses claim {claim['name']}, "
                                             "which the pod's resourceClaims do not declare")
            if declared and not any((c.get("resources") or {}).get("claims") for c in check_recipes.walk_containers(pod)):
                report.fail(p_where, "declares resourceClaims no container uses")


# ---- The node's start script: the node config fracgpud gets ----

def check_node_config(docs, fracgpud, simcuda, report):
    """Runs the fracgpud container's script with a fake nvidia-smi listing two
    simulated GPUs; the config it writes must pass `fracgpud --check` and hold
    one [[gpu]] per GPU and no tenant. A UUID of another form, or nvidia-smi
    failing, must stop it."""
    ds = next((d for w, d in install_docs(docs) if d.get("kind") == "DaemonSet"), None)
    config_map = next((d for w, d in install_docs(docs) if d.get("kind") == "ConfigMap"), None)
    if ds is None or config_map is None:
        return
    where = "deploy/daemonset.yaml: container fracgpud"
    daemon = next(c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "fracgpud")
    command = list(daemon.get("command", [])) + list(daemon.get("args", []))
    env = {e["name"]: e.get("value") for e in daemon.get("env", [])}
    if command[:1] != ["bash"] or "-c" not in command:
        report.fail(where, f"the command is not a bash script: {command[:3]}")
        return
    script = command[command.index("-c") + 1]
    uuids = ["GPU-5eed0001-0000-4000-8000-0000000000a0", "GPU-5eed0001-0000-4000-8000-0000000000a1"]
    with tempfile.TemporaryDirectory(prefix="fracgpu-node-config-") as tmp:
        tmp = pathlib.Path(tmp)
        (tmp / "bin").mkdir()
        base = tmp / "fracgpud.toml"
        # The daemon's run dir stands in for /run/fracgpu (--check does not write it).
        base.write_text(re.sub(r'^(\s*run_dir\s*=\s*)"[^"]*"', f'\\1"{tmp / "run"}"',
                               config_map["data"]["fracgpud.toml"], flags=re.M))
        fake_smi = tmp / "bin" / "nvidia-smi"
        fake_daemon = tmp / "bin" / "fracgpud"
        fake_daemon.write_text(f'#!/bin/sh\nexec "{fracgpud}" --check "$@"\n')
        fake_daemon.chmod(0o755)
        for needed in ("FRACGPU_BASE_CONFIG", "FRACGPU_NODE_CONFIG"):
            if not env.get(needed):
                report.fail(where, f"{needed} is not set")
                return
        run_env = dict(os.environ, PATH=f"{tmp / 'bin'}:{os.environ['PATH']}", FRACGPU_BASE_CONFIG=str(base),
                       FRACGPU_NODE_CONFIG=str(tmp / "node.toml"), LD_LIBRARY_PATH=simcuda,
                       SIMCUDA_DEVICES=";".join(f"uuid={u},name=Sim GPU,mem=16GiB,ctx=64MiB" for u in uuids))
        run_env.pop("SIMCUDA_STATE", None)

        def run(smi_body):
            fake_smi.write_text("#!/bin/sh\n" + smi_body)
            fake_smi.chmod(0o755)
            return subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=run_env, capture_output=True,
                                  text=True, timeout=60)

        result = run("".join(f"echo {u}\n" for u in uuids))
        if result.returncode != 0:
            report.fail(where, f"the node config it writes for two GPUs does not pass fracgpud --check "
                               f"(exit {result.returncode}): {result.stdout}{result.stderr}")
        else:
            written = (tmp / "node.toml").read_text()
            listed = re.findall(r'^\s*uuid\s*=\s*"([^"]+)"', written, re.M)
            if listed != uuids or "[[tenant]]" in written:
                report.fail(where, f"the node config lists GPUs {listed} (expected {uuids}), tenants: "
                                   f"{'[[tenant]]' in written}")
        for smi, why in (('echo GPU-5eed0001-0000-4000-8000-0000000000a0\necho \'GPU-1"\n[[tenant]]\'\n',
                          "a GPU UUID of another form"),
                         ("echo 'NVIDIA-SMI has failed' >&2\nexit 9\n", "nvidia-smi failing")):
            if run(smi).returncode == 0:
                report.fail(where, f"the start script went on after {why}")


# ---- Booking claims on the published slice, as the 1.36 kube-scheduler does ----

def policy_errors(name, capacity):
    """The API server's rules for a capacity's requestPolicy (resource/v1
    validation): default required with a validRange, default and max
    reachable from min in steps, min + step within the value."""
    where = f"capacity {name}"
    value = parse_quantity(capacity.get("value"))
    policy = capacity.get("requestPolicy")
    if value is None:
        return [f"{where}: value {capacity.get('value')!r} is not a quantity"]
    if not policy:
        return []
    errors = []
    default = parse_quantity(policy.get("default")) if policy.get("default") is not None else None
    valid_range = policy.get("validRange")
    if policy.get("validValues") and valid_range:
        errors.append(f"{where}: validValues and validRange both set")
    if (valid_range or policy.get("validValues")) and default is None:
        errors.append(f"{where}: a validRange or validValues needs a default")
    if valid_range:
        lo = parse_quantity(valid_range.get("min")) if "min" in valid_range else None
        hi = parse_quantity(valid_range["max"]) if "max" in valid_range else None
        step = parse_quantity(valid_range["step"]) if "step" in valid_range else None
        if lo is None:
            return errors + [f"{where}: validRange without min"]
        if lo > value or (hi is not None and (hi > value or lo > hi)):
            errors.append(f"{where}: min {show(lo)} / max {show(hi) if hi is not None else '-'} outside 0..{show(value)}")
        if default is not None and (default < lo or (hi is not None and default > hi)):
            errors.append(f"{where}: default {show(default)} outside min..max")
        if step is not None:
            if lo + step > value:
                errors.append(f"{where}: min + step {show(lo + step)} is above the value {show(value)}")
            for what, q in (("default", default), ("max", hi)):
                if q is not None and (value_of(q) - value_of(lo)) % value_of(step) != 0:
                    errors.append(f"{where}: {what} {show(q)} is not min plus whole steps (as Value() rounds them)")
    return errors


def consumed(asked, capacity):
    """What the 1.36 scheduler books for a request of `asked` (None: not
    named) from a capacity: k8s.io/dynamic-resource-allocation's
    calculateConsumedCapacity, whose validRange arithmetic is Value()'s,
    whole units rounded up (DRAFractionalCapacityRange, which would use
    thousandths, is not in 1.36)."""
    value = parse_quantity(capacity["value"])
    policy = capacity.get("requestPolicy")
    if asked is None:
        if policy and policy.get("default") is not None:
            return parse_quantity(policy["default"])
        return value
    if not policy:
        return asked
    valid_range = policy.get("validRange")
    if valid_range and valid_range.get("min") is not None:
        lo = parse_quantity(valid_range["min"])
        if asked < lo:
            return lo
        if valid_range.get("step") is None:
            return asked
        step = value_of(parse_quantity(valid_range["step"]))
        added = value_of(asked) - value_of(lo)
        n = added // step + (1 if added % step else 0)
        return fractions.Fraction(value_of(lo) + step * n)
    for v in policy.get("validValues") or []:
        if asked <= parse_quantity(v):
            return parse_quantity(v)
    return asked


def violates(booked, capacity):
    policy = capacity.get("requestPolicy") or {}
    if policy.get("default") is not None and booked == parse_quantity(policy["default"]):
        return False
    valid_range = policy.get("validRange")
    if valid_range:
        if valid_range.get("max") is not None and booked > parse_quantity(valid_range["max"]):
            return True
        if valid_range.get("step") is not None:
            lo, step = parse_quantity(valid_range["min"]), parse_quantity(valid_range["step"])
            return (value_of(booked) - value_of(lo)) % value_of(step) != 0
    if policy.get("validValues"):
        return booked not in [parse_quantity(v) for v in policy["validValues"]]
    return False


def book(request, device):
    """{capacity: booked} for a request on a device, or a reason it cannot go there."""
    capacities = device.get("capacity", {})
    asked = requested(request)
    if set(asked) - set(capacities):
        return f"asks for capacities {sorted(set(asked) - set(capacities))} the device does not have"
    booked = {}
    for name, capacity in capacities.items():
        amount = consumed(asked.get(name), capacity)
        if violates(amount, capacity) or amount > parse_quantity(capacity["value"]):
            return f"{name}: {show(amount)} does not fit the device's {show(parse_quantity(capacity['value']))}"
        booked[name] = amount
    return booked


def check_request_policy(docs, resource_slice, report):
    import kubernetes_validate.utils as kv
    where = "the plugin's ResourceSlice"
    try:
        kv.validate(resource_slice, KUBERNETES_VERSION, strict=True)
    except kv.ValidationError as e:
        report.fail(where, f"is not valid Kubernetes {KUBERNETES_VERSION}: {'.'.join(map(str, e.path))}: {e.message}")
    devices = resource_slice.get("spec", {}).get("devices", [])
    if not devices:
        report.fail(where, "has no devices")
        return
    for device in devices:
        for name, capacity in device.get("capacity", {}).items():
            for error in policy_errors(name, capacity):
                report.fail(f"{where}: device {device.get('name')}", error)
        if not device.get("allowMultipleAllocations"):
            report.fail(f"{where}: device {device.get('name')}", "does not allow multiple allocations")
    attributes = set.intersection(*(set(d.get("attributes", {})) for d in devices))

    examples = [(w, d) for w, d in docs if w.startswith("deploy/examples/")]
    replicas = {}
    for _, d in examples:
        for pod in pod_specs(d):
            for rc in pod.get("resourceClaims", []):
                if rc.get("resourceClaimTemplateName"):
                    replicas[rc["resourceClaimTemplateName"]] = d.get("spec", {}).get("replicas", 1) \
                        if d.get("kind") != "Pod" else 1
    for c_where, name, claim in claim_specs(examples):
        c_where = f"{c_where}: claim {name}"
        needed = 0
        for request_name, request in requests_of(claim):
            r_where = f"{c_where}: request {request_name}"
            asked = requested(request)
            if any(v is None for v in asked.values()):
                continue  # reported by check_examples
            places = [(device, book(request, device)) for device in devices]
            fitting = [(device, booked) for device, booked in places if isinstance(booked, dict)]
            count = request.get("count", 1) if request.get("allocationMode", "ExactCount") == "ExactCount" else 1
            needed += count
            if len(fitting) < count:
                report.fail(r_where, f"fits {len(fitting)} of the node's {len(devices)} GPUs, needs {count}: "
                                     + "; ".join(f"{d.get('name')}: {b}" for d, b in places if isinstance(b, str)))
                continue
            for capacity, amount in asked.items():
                rounded = [(device, booked[capacity]) for device, booked in fitting if booked[capacity] != amount]
                if rounded:
                    device, booking = rounded[0]
                    report.fail(r_where, f"{capacity} {show(amount)} would be booked as {show(booking)} on "
                                         f"{len(rounded)} of the {len(fitting)} GPUs it fits (e.g. {device.get('name')}: "
                                         f"requestPolicy {json.dumps(device['capacity'][capacity].get('requestPolicy'))}, "
                                         "rounded as the 1.36 scheduler does): ask for what is booked")
            copies = replicas.get(name, 1)
            if copies > 1 and asked:
                # "Fit on one GPU together": the copies' bookings add up within one device.
                if not any(all(booked[c] * copies <= parse_quantity(device["capacity"][c]["value"]) for c in booked)
                           for device, booked in fitting):
                    report.fail(r_where, f"{copies} replicas of it do not fit on one GPU of the node")
        if needed > len(devices):
            report.fail(c_where, f"needs {needed} GPUs, the node has {len(devices)}")
        for i, constraint in enumerate(claim.get("devices", {}).get("constraints", [])):
            for key in ("matchAttribute", "distinctAttribute"):
                attribute = constraint.get(key, "")
                if attribute and attribute.split("/", 1)[-1] not in attributes:
                    report.fail(f"{c_where}: constraints[{i}]", f"{key} {attribute}: the plugin publishes no such "
                                                                 f"attribute (it has {sorted(attributes)})")
    # Pods asking in the old style: the claim the scheduler makes for each,
    # booked on the node as the scheduler books it (fake_scheduler.py).
    classes = [d for w, d in install_docs(docs) if d.get("kind") == "DeviceClass"]
    for p_where, d in examples:
        for pod in pod_specs(d):
            meta = {"name": d["metadata"]["name"], "uid": "0", "namespace": "default"}
            try:
                claim, _ = fake_scheduler.extended_claim({"metadata": meta, "spec": pod}, classes)
                if claim is not None:
                    fake_scheduler.allocate(claim, classes, [resource_slice], resource_slice["spec"].get("nodeName"), {})
            except fake_scheduler.Invalid:
                continue  # reported by check_examples
            except (fake_scheduler.Unschedulable, ValueError) as e:
                report.fail(f"{p_where}: {name_of(d)}", f"its extended resources' claim does not fit the node: {e}")


def build_slice(builder, node):
    result = subprocess.run([builder, str(node)], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise SystemExit(f"FAIL: {builder} {node} exited {result.returncode}: {result.stderr}")
    return json.loads(result.stdout)


# ---- Breaking the manifests on purpose ----

def mutations(docs, resource_slice):
    """(what is broken, docs, slice, the message expected) for each way the
    checks must catch."""

    def edit(where_prefix, kind, change, name=None):
        broken = copy.deepcopy(docs)
        for where, d in broken:
            if where.startswith(where_prefix) and d.get("kind") == kind and (name is None or d["metadata"]["name"] == name):
                change(d)
        return broken

    def half_gpu_requests(change):
        """The half-GPU example with its capacity requests changed."""
        return edit("deploy/examples/half", "ResourceClaimTemplate",
                    lambda d: change(d["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]))

    def container(ds, name):
        return next(c for c in check_recipes.walk_containers(ds["spec"]["template"]["spec"]) if c["name"] == name)

    def set_share_step(s):
        s = copy.deepcopy(s)
        for device in s["spec"]["devices"]:
            share = device["capacity"]["share"]
            share["requestPolicy"] = {"default": share["value"],
                                      "validRange": {"min": "1m", "max": share["value"], "step": "1m"}}
        return s

    yield ("the DaemonSet left out of the kustomization",
           edit("deploy/kustomization", "Kustomization", lambda d: d["resources"].remove("daemonset.yaml")),
           None, "deploy/daemonset.yaml is not among its resources")
    yield ("the kubelet plugin made privileged",
           edit("deploy/daemonset", "DaemonSet",
                lambda d: container(d, "kubelet-plugin")["securityContext"].update(privileged=True)),
           None, "container kubelet-plugin: is privileged")
    yield ("the admission policy naming another namespace",
           edit("deploy/admission", "ValidatingAdmissionPolicy",
                lambda d: d["spec"]["matchConditions"][0].update(
                    expression=d["spec"]["matchConditions"][0]["expression"].replace(":fracgpu:", ":kube-system:"))),
           None, "it would never apply")
    yield ("watch added to the plugin's role",
           edit("deploy/rbac", "ClusterRole", lambda d: d["rules"][1]["verbs"].append("watch")),
           None, "not exactly what the plugin needs")
    yield ("the driver's status permission for every driver",
           edit("deploy/rbac", "ClusterRole", lambda d: d["rules"][2].pop("resourceNames")),
           None, "not for the driver's name alone")
    yield ("the init container copying onto the interposer in place",
           edit("deploy/daemonset", "DaemonSet",
                lambda d: container(d, "install-library").update(
                    command=["sh", "-ec", "cp /usr/lib/fracgpu/libfracgpu.so /host/usr/local/lib/fracgpu/libfracgpu.so"])),
           None, "writes the host's interposer with cp")
    yield ("the CDI dir mounted elsewhere in the plugin",
           edit("deploy/daemonset", "DaemonSet",
                lambda d: next(m for m in container(d, "kubelet-plugin")["volumeMounts"]
                               if m["name"] == "cdi").update(mountPath="/cdi")),
           None, "--cdi-dir /var/run/cdi is not a hostPath volume mounted at the same path")
    yield ("the token automounted into every container",
           edit("deploy/daemonset", "DaemonSet",
                lambda d: d["spec"]["template"]["spec"].pop("automountServiceAccountToken")),
           None, "automounts the service account's token")
    yield ("a memory request written with a space",
           half_gpu_requests(lambda r: r.update(memory="20 GiB")),
           None, "'20 GiB' is not a Kubernetes quantity")
    yield ("a request for memory alone",
           half_gpu_requests(lambda r: r.pop("share")),
           None, "asks for memory but not share")
    yield ("a limit below the share",
           edit("deploy/examples/limit", "ResourceClaimTemplate",
                lambda d: d["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"].update(limit="0.1")),
           None, "limit 0.1 is below the share 250m")
    yield ("a priority the plugin does not take",
           edit("deploy/examples/limit", "ResourceClaimTemplate",
                lambda d: d["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"].update(priority="urgent")),
           None, "priority 'urgent' is not")
    def extended_limits(change):
        """The old-style example pod with its container's limits changed."""
        return edit("deploy/examples/extended", "Pod",
                    lambda d: change(d["spec"]["containers"][0]["resources"]["limits"]))

    yield ("an extended resource no DeviceClass stands for",
           extended_limits(lambda l: l.update({"gpu.fracgpu.io/gpus": l.pop("gpu.fracgpu.io/gpu")})),
           None, "which no DeviceClass of deploy/ stands for")
    yield ("half of an extended resource",
           extended_limits(lambda l: l.update({"gpu.fracgpu.io/gpu": "500m"})),
           None, "must be an integer")
    if resource_slice is not None:
        yield ("more whole GPUs in the old style than the node has",
               extended_limits(lambda l: l.update({"gpu.fracgpu.io/gpu": 5})),
               resource_slice, "its extended resources' claim does not fit the node")
        yield ("share published with a 1m step (1.36 books 500m as 1)", docs, set_share_step(resource_slice),
               "share 500m would be booked as 1")
        yield ("memory asked off the 256Mi grid",
               half_gpu_requests(lambda r: r.update(memory="20000Mi")),
               resource_slice, "memory 20000Mi would be booked as 20224Mi")
        yield ("a constraint on an attribute the plugin does not publish",
               edit("deploy/examples/two-and-a-half", "ResourceClaimTemplate",
                    lambda d: d["spec"]["spec"]["devices"]["constraints"][0].update(
                        distinctAttribute="gpu.fracgpu.io/serial")),
               resource_slice, "the plugin publishes no such attribute")


def run_checks(source, docs, resource_slice, schemas):
    report = Report()
    if schemas:
        check_kustomization(source, docs, report)
        check_install(docs, report)
        check_examples(docs, report)
    if resource_slice is not None:
        check_request_policy(docs, resource_slice, report)
    return report.errors


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--source", required=True, type=pathlib.Path)
    parser.add_argument("--schemas", action="store_true", help="schemas and cross-checks of deploy/")
    parser.add_argument("--fracgpud", help="a built fracgpud, to --check the node config the DaemonSet writes")
    parser.add_argument("--simcuda", help="the simulated driver's directory (with --fracgpud)")
    parser.add_argument("--slice-builder", help="tests/k8s_manifests/slice_dump, built against the plugin's code")
    parser.add_argument("--node", type=pathlib.Path, help="the control API NODE object the slice is built from")
    args = parser.parse_args()

    try:
        import kubernetes_validate.utils as kv
    except ImportError as e:
        print(f"SKIPPED: kubernetes-validate cannot be imported ({e}); scripts/install-deps.sh installs it "
              "(pip install kubernetes-validate==1.37.0, whose schemas include Kubernetes 1.36)")
        return SKIP
    if KUBERNETES_VERSION not in kv.all_versions():
        print(f"FAIL: kubernetes-validate has no schemas for {KUBERNETES_VERSION} (it has up to {kv.latest_version()})")
        return 1

    docs = load(args.source)
    resource_slice = build_slice(args.slice_builder, args.node) if args.slice_builder else None
    report = Report()
    if args.schemas:
        validate_schemas(docs, report)
        check_kustomize_build(args.source, docs, report)
        if args.fracgpud:
            check_node_config(docs, args.fracgpud, args.simcuda, report)
    errors = report.errors + run_checks(args.source, docs, resource_slice, args.schemas)
    for e in errors:
        print(f"FAIL: {e}", file=sys.stderr)
    print(f"checked {len({w for w, _ in docs})} manifest(s), {len(docs)} object(s) under deploy/ "
          f"(Kubernetes {KUBERNETES_VERSION}): {len(errors)} problem(s)")

    missed = 0
    for what, broken, broken_slice, expected in mutations(docs, resource_slice):
        if broken_slice is not None and not args.slice_builder:
            continue
        if broken_slice is None and not args.schemas:
            continue
        found = run_checks(args.source, broken, broken_slice, args.schemas and broken_slice is None)
        if not any(expected in e for e in found):
            missed += 1
            print(f"FAIL: {what}: not reported (expected \"{expected}\"); reported: {found}", file=sys.stderr)
        else:
            print(f"caught: {what}")
    return 1 if errors or missed else 0


if __name__ == "__main__":
    sys.exit(main())
