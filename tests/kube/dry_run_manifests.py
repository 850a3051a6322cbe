#!/usr/bin/env python3
"""Server-side dry runs of deploy/ and deploy/examples/ against the stand-in
API server (fake_apiserver.py), as `kubectl apply --dry-run=server` makes
them: every object of every file is created (POST ?dryRun=All) and applied
(PATCH, server-side apply, ?dryRun=All) and must be accepted, answered as
it would be stored (uid, creationTimestamp, no resourceVersion, the
defaults), and left unstored (a GET after it: 404).

Also: an invalid dryRun value is refused as upstream refuses it (422,
CreateOptions / PatchOptions); the namespaced objects are refused while
their namespace does not exist (NamespaceLifecycle), as on an empty
cluster; a dry run of an object that exists is AlreadyExists on create
and, on apply, answers the change without storing it; and each of a set
of deliberate breakages is refused by the dry run with exactly the error
a real write gets (and the real write stores nothing either).

Exit 77 (skipped) when PyYAML or kubernetes-validate cannot be imported.

Usage: dry_run_manifests.py --source DIR
"""
import argparse
import copy
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

SKIP = 77
HERE = pathlib.Path(__file__).resolve().parent


class Api:
    def __init__(self, port):
        self.base = "http://127.0.0.1:%d" % port
        self.discovered = {}

    def call(self, method, path, body=None, content_type="application/json"):
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read() or b"null"), dict(response.headers)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null"), dict(e.headers)

    def resource_of(self, doc):
        """(resource, namespaced) for the doc's apiVersion and kind, by discovery as kubectl finds it."""
        api_version = doc["apiVersion"]
        if api_version not in self.discovered:
            path = "/api/v1" if api_version == "v1" else "/apis/" + api_version
            code, body, _ = self.call("GET", path)
            self.discovered[api_version] = body.get("resources", []) if code == 200 else []
        for r in self.discovered[api_version]:
            if r["kind"] == doc["kind"] and "/" not in r["name"]:
                return r["name"], r["namespaced"]
        raise LookupError("the stand-in serves no %s %s" % (api_version, doc["kind"]))

    def collection(self, doc, namespace="default"):
        resource, namespaced = self.resource_of(doc)
        prefix = "/api/v1" if doc["apiVersion"] == "v1" else "/apis/" + doc["apiVersion"]
        if namespaced:
            namespace = doc.get("metadata", {}).get("namespace") or namespace
            return "%s/namespaces/%s/%s" % (prefix, namespace, resource)
        return "%s/%s" % (prefix, resource)

    def item(self, doc):
        return self.collection(doc) + "/" + urllib.parse.quote(doc["metadata"]["name"])

    def create(self, doc, dry=True, extra=""):
        query = "?fieldManager=kubectl-create&fieldValidation=Strict" + ("&dryRun=All" if dry else "") + extra
        return self.call("POST", self.collection(doc) + query, doc)

    def apply(self, doc, dry=True, extra=""):
        query = "?fieldManager=kubectl&force=true" + ("&dryRun=All" if dry else "") + extra
        return self.call("PATCH", self.item(doc) + query, doc, "application/apply-patch+yaml")

    def get(self, doc):
        return self.call("GET", self.item(doc))


class Report:
    def __init__(self):
        self.errors = []
        self.checks = 0

    def expect(self, ok, where, message):
        self.checks += 1
        if not ok:
            self.errors.append("%s: %s" % (where, message))
        return ok


def load(source):
    docs = []
    for path in sorted((source / "deploy").glob("*.yaml")) + sorted((source / "deploy" / "examples").glob("*.yaml")):
        import yaml
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None and doc.get("kind") != "Kustomization":
                docs.append(("%s#%d %s/%s" % (path.relative_to(source), i, doc.get("kind"),
                                              doc.get("metadata", {}).get("name")), doc))
    return docs


def name_of(doc):
    return "%s/%s" % (doc.get("kind"), doc.get("metadata", {}).get("name"))


def check_stored_shape(report, where, doc, answer, code_wanted, code):
    """What a dry run answers: the object as it would be stored, server fields set, no resourceVersion."""
    if not report.expect(code == code_wanted, where, "answered %s, not %s: %s" % (code, code_wanted,
                                                                                answer.get("message", answer))):
        return
    meta = answer.get("metadata", {})
    report.expect(bool(meta.get("uid")) and bool(meta.get("creationTimestamp")), where,
                  "no uid or creationTimestamp in the answer: %s" % meta)
    report.expect("resourceVersion" not in meta, where, "a dry run answered a resourceVersion: %s" % meta)
    report.expect(meta.get("name") == doc["metadata"]["name"], where, "the answer names %s" % meta.get("name"))
    if doc["kind"] == "ResourceClaimTemplate":
        for req in answer["spec"]["spec"]["devices"]["requests"]:
            exact = req.get("exactly") or {}
            report.expect(exact.get("allocationMode") == "ExactCount" and exact.get("count", 0) >= 1, where,
                          "request %s not defaulted as the v1 API defaults it: %s" % (req.get("name"), exact))


# ---- deliberate breakages: (file suffix, kind, what, mutate, text in the error)

def _first_container(doc):
    spec = doc["spec"]["template"]["spec"] if "template" in doc.get("spec", {}) else doc["spec"]
    return spec["containers"][0]


def _set(path):
    def mutate(doc, value):
        target = doc
        for p in path[:-1]:
            target = target[p]
        target[path[-1]] = value
    return mutate


BREAKAGES = [
    ("deploy/deviceclass.yaml", "DeviceClass", "an extended resource name in kubernetes.io",
     lambda d: d["spec"].__setitem__("extendedResourceName", "kubernetes.io/gpu"),
     422, "spec.extendedResourceName: Invalid value"),
    ("deploy/deviceclass.yaml", "DeviceClass", "a driver name in capitals",
     lambda d: d["spec"]["config"][0]["opaque"].__setitem__("driver", "GPU.fracgpu.io"),
     422, "spec.config[0].opaque.driver: Invalid value"),
    # (A count of 0 is no breakage: the v1 defaults make it 1.)
    ("half-gpu-pod.yaml", "ResourceClaimTemplate", "a count of -1",
     lambda d: d["spec"]["spec"]["devices"]["requests"][0]["exactly"].__setitem__("count", -1),
     422, "spec.spec.devices.requests[0].exactly.count: Invalid value: -1: must be greater than zero"),
    ("training-job-two-and-a-half-gpus.yaml", "ResourceClaimTemplate", "a constraint naming no request",
     lambda d: d["spec"]["spec"]["devices"]["constraints"][0].__setitem__("requests", ["whole", "halve"]),
     422, "spec.spec.devices.constraints[0].requests[1]: Invalid value"),
    ("half-gpu-pod.yaml", "ResourceClaimTemplate", "a capacity request that is not a quantity",
     lambda d: d["spec"]["spec"]["devices"]["requests"][0]["exactly"].setdefault("capacity", {"requests": {}})
     ["requests"].__setitem__("memory", "20 GiB"), 422, "not a quantity"),
    ("training-job-two-and-a-half-gpus.yaml", "Job", "restartPolicy Always in a Job",
     lambda d: d["spec"]["template"]["spec"].__setitem__("restartPolicy", "Always"),
     422, 'spec.template.spec.restartPolicy: Unsupported value: "Always"'),
    ("vllm-inference-deployment.yaml", "Deployment", "a selector the template's labels do not match",
     lambda d: d["spec"]["selector"]["matchLabels"].__setitem__("app", "not-vllm"),
     422, "`selector` does not match template `labels`"),
    ("shared-gpu-deployment.yaml", "Deployment", "a container claim the pod does not have",
     lambda d: _first_container(d)["resources"]["claims"][0].__setitem__("name", "no-such-claim"),
     422, "must be one of the names in pod.spec.resourceClaims"),
    ("extended-resource-pod.yaml", "Pod", "half of an extended resource",
     lambda d: _first_container(d)["resources"]["limits"].__setitem__("gpu.fracgpu.io/gpu", "500m"),
     422, "must be an integer"),
    ("two-claims-one-container.yaml", "Pod", "a misspelt field (fieldValidation=Strict)",
     lambda d: _first_container(d).__setitem__("resoures", _first_container(d).get("resources")),
     400, 'strict decoding error: unknown field "spec.containers.0.resoures"'),
    ("deploy/configmap.yaml", "ConfigMap", "a namespace other than the request's",
     lambda d: d["metadata"].__setitem__("namespace", "default"), 400,
     "the namespace of the provided object does not match the namespace sent on the request"),
    ("deploy/rbac.yaml", "ClusterRole", "a label value with a space",
     lambda d: d["metadata"].setdefault("labels", {}).__setitem__("team", "gpu sharing"),
     422, "metadata.labels: Invalid value"),
]


def run_breakages(api, docs, report):
    for suffix, kind, what, mutate, code_wanted, text in BREAKAGES:
        found = [d for w, d in docs if w.split("#")[0].endswith(suffix) and d.get("kind") == kind]
        where = "breakage %s %s (%s)" % (suffix, kind, what)
        if not report.expect(bool(found), where, "no such object in deploy/ (a breakage that checks nothing)"):
            continue
        doc = copy.deepcopy(found[0])
        mutate(doc)
        # The collection of the original: a changed namespace must not move the request.
        path = api.collection(found[0])
        query = "?fieldManager=kubectl-create&fieldValidation=Strict"
        dry = api.call("POST", path + query + "&dryRun=All", doc)
        real = api.call("POST", path + query, doc)
        report.expect(dry[0] == code_wanted and text in (dry[1] or {}).get("message", ""), where,
                      "the dry run answered %s %s, not %s with %r" % (dry[0], (dry[1] or {}).get("message"),
                                                                     code_wanted, text))
        report.expect((dry[0], dry[1]) == (real[0], real[1]), where,
                      "the dry run's refusal %s %s differs from the real write's %s %s"
                      % (dry[0], dry[1], real[0], real[1]))
        if not report.expect(api.call("GET", path + "/" + doc["metadata"]["name"])[0] == 404, where,
                             "the refused write stored the object"):
            api.call("DELETE", path + "/" + doc["metadata"]["name"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", required=True, type=pathlib.Path)
    args = parser.parse_args()
    try:
        import yaml  # noqa: F401
        import kubernetes_validate.utils  # noqa: F401
    except ImportError as e:
        print("SKIPPED: %s (scripts/install-deps.sh installs PyYAML and kubernetes-validate)" % e)
        return SKIP
    docs = load(args.source.resolve())
    report = Report()
    files = {w.split("#")[0] for w, _ in docs}
    report.expect(len(files) >= 10 and any("examples/" in f for f in files), "deploy/",
                  "only %d files found: %s" % (len(files), sorted(files)))

    with tempfile.TemporaryDirectory() as tmp:
        port_file = os.path.join(tmp, "port")
        server = subprocess.Popen([sys.executable, str(HERE / "fake_apiserver.py"), "--port-file", port_file,
                                   "--log", os.path.join(tmp, "log")])
        try:
            deadline = time.time() + 20
            while not os.path.exists(port_file):
                if server.poll() is not None or time.time() > deadline:
                    print("FAIL: the stand-in API server did not start")
                    return 1
                time.sleep(0.05)
            api = Api(int(open(port_file).read()))
            run(api, docs, report)
        finally:
            server.terminate()
            server.wait(timeout=10)

    for e in report.errors:
        print("FAIL: " + e)
    if report.errors:
        return 1
    print("ok: %d objects from %d files dry-run (create and apply), %d breakages refused alike, %d checks"
          % (len(docs), len(files), len(BREAKAGES), report.checks))
    return 0


def run(api, docs, report):
    namespace_doc = next((d for _, d in docs if d["kind"] == "Namespace"), None)
    report.expect(namespace_doc is not None, "deploy/", "no Namespace")
    namespaces = {d.get("metadata", {}).get("namespace") for _, d in docs} - {None, "default"}

    # An invalid dryRun value: upstream's 422 (ValidateDryRun), nothing stored.
    some = namespace_doc or docs[0][1]
    code, body, _ = api.create(some, dry=False, extra="&dryRun=Yes")
    report.expect(code == 422 and body.get("reason") == "Invalid" and body.get("message") ==
                  'CreateOptions.meta.k8s.io "" is invalid: dryRun: Unsupported value: []string{"Yes"}: '
                  'supported values: "All"', "dryRun=Yes on create", "answered %s %s" % (code, body))
    code, body, _ = api.apply(some, dry=False, extra="&dryRun=true")
    report.expect(code == 422 and body.get("message", "").startswith('PatchOptions.meta.k8s.io "" is invalid: '
                                                                     "dryRun: Unsupported value"),
                  "dryRun=true on apply", "answered %s %s" % (code, body))
    report.expect(api.get(some)[0] == 404, "dryRun=Yes", "the refused request stored the object")

    # On an empty cluster the install's namespace does not exist yet: a dry
    # run of what goes in it is refused (NamespaceLifecycle), as
    # `kubectl apply --dry-run=server -k deploy/` is on a real one.
    for where, doc in docs:
        if doc.get("metadata", {}).get("namespace") in namespaces:
            code, body, _ = api.create(doc)
            report.expect(code == 404 and body.get("message") == 'namespaces "%s" not found'
                          % doc["metadata"]["namespace"], where + " (no namespace yet)",
                          "answered %s %s" % (code, body.get("message")))
    # Its Namespace created for real; then every object dry-runs.
    code, body, _ = api.create(namespace_doc, dry=False)
    report.expect(code == 201, "Namespace", "not created: %s %s" % (code, body))

    for where, doc in docs:
        if doc["kind"] == "Namespace":
            continue
        for verb, call in (("create", api.create), ("apply", api.apply)):
            try:
                code, body, headers = call(doc)
            except LookupError as e:
                report.expect(False, where, str(e))
                break
            check_stored_shape(report, "%s (dry-run %s)" % (where, verb), doc, body, 201, code)
            report.expect("Warning" not in headers, where, "warnings: %s" % headers.get("Warning"))
            report.expect(api.get(doc)[0] == 404, "%s (dry-run %s)" % (where, verb), "stored: a GET finds it")

    # A dry run of an object that exists: create is AlreadyExists; apply
    # answers the change (generation raised, the stored resourceVersion) and
    # stores nothing.
    classes = [d for _, d in docs if d["kind"] == "DeviceClass"]
    if report.expect(bool(classes), "deploy/", "no DeviceClass"):
        cls = classes[0]
        code, stored, _ = api.create(cls, dry=False)
        report.expect(code == 201 and stored["metadata"].get("resourceVersion"), "DeviceClass real create",
                      "answered %s %s" % (code, stored))
        code, body, _ = api.create(cls)
        report.expect(code == 409 and body.get("reason") == "AlreadyExists" and body.get("message") ==
                      'deviceclasses.resource.k8s.io "%s" already exists' % cls["metadata"]["name"],
                      "DeviceClass dry-run create over the stored one", "answered %s %s" % (code, body))
        changed = copy.deepcopy(cls)
        changed["spec"]["selectors"][0]["cel"]["expression"] += " && true"
        code, body, _ = api.apply(changed)
        report.expect(code == 200 and body["spec"] == changed["spec"] and body["metadata"]["generation"] == 2
                      and body["metadata"].get("resourceVersion") == stored["metadata"].get("resourceVersion")
                      and body["metadata"]["uid"] == stored["metadata"]["uid"],
                      "DeviceClass dry-run apply over the stored one", "answered %s %s" % (code, body))
        code, now, _ = api.get(cls)
        report.expect(code == 200 and now == stored, "DeviceClass after the dry-run apply",
                      "the stored object changed: %s" % now)
        code, _, _ = api.call("DELETE", api.item(cls) + "?dryRun=All")
        report.expect(code == 200 and api.get(cls)[0] == 200, "DeviceClass dry-run delete", "deleted it")
        api.call("DELETE", api.item(cls))

    run_breakages(api, docs, report)


if __name__ == "__main__":
    sys.exit(main())
