"""The kube-scheduler's part for a pod that asks for an extended resource a
DeviceClass stands for (DRAExtendedResource, KEP-5004), as a model for tests
(Python 3 standard library only).

A DeviceClass with spec.extendedResourceName "gpu.fracgpu.io/gpu" (or any
class, under its implicit name "deviceclass.resource.kubernetes.io/<class>")
lets a pod ask in the old style, `resources.limits: {gpu.fracgpu.io/gpu: 1}`.
No claim is written by the user: the scheduler makes one for the pod, books
devices in it, and records in the pod's status which request serves which
container. The kubelet then prepares that claim like any other.

What the real scheduler writes, field by field, as Kubernetes 1.36 does it
(k8s.io/kubernetes, pkg/scheduler/framework/plugins/dynamicresources/):

  extendeddynamicresources.go, preFilterExtendedResources: the claim in the
    pod's namespace, metadata.generateName "<pod name>-extended-resources-"
    (the API server adds 5 random characters; a base longer than 58 is cut
    to 58), the annotation resource.kubernetes.io/extended-resource-claim:
    "true", one owner reference {apiVersion v1, kind Pod, name, uid,
    controller: true} (no blockOwnerDeletion), spec.devices empty until
    Filter fills it.
  extendeddynamicresources.go, createRequestsAndMappings and
    createResourceRequestAndMappings: one request per container and
    extended resource, named "container-<i>-request-<j>" (i: the container's
    index in initContainers followed by containers; j: the resource's index
    among the container's requests sorted by name), exactly {deviceClassName,
    allocationMode ExactCount, count: the container's request}; no
    capacity, no selectors, no tolerations. An init container that is not a
    sidecar reuses the requests of the long-lived containers after it when
    they add up to what it asks, and only the largest of such init
    containers' own requests is kept; the requests end sorted by name. The
    mapping {containerName, resourceName, requestName} is recorded for each
    container.
  extended/util.go, DeviceClassMapping: a class maps its
    spec.extendedResourceName, or "deviceclass.resource.kubernetes.io/<its
    name>" when it has none. (Two classes with one name: the one created
    later wins, then the name sorted first; resource/v1 types.go.)
  extendeddynamicresources.go, createExtendedResourceClaimInAPI: the claim
    is created (name and uid by the API server) in PreBind; then, as for
    every claim (dynamicresources.go, bindClaim): the finalizer
    resource.kubernetes.io/delete-protection, status.allocation and
    status.reservedFor [{resource: pods, name, uid}].
  extendeddynamicresources.go, patchPodExtendedResourceClaimStatus: the pod's
    status.extendedResourceClaimStatus {requestMappings, resourceClaimName}.

The allocation follows k8s.io/dynamic-resource-allocation's allocator with
DRAConsumableCapacity (structured/internal/incubating/allocator_incubating.go,
allocateDevice): a request of count N takes N distinct devices (the search
for a request's next device starts after the previous one), each result
books consumedCapacity, for a capacity the request does not name its
requestPolicy.default or else its whole value (GetConsumedCapacityFromRequest),
and gets a shareID; the class's config is passed on with source FromClass
for the request. Devices tainted NoSchedule or NoExecute are not taken (the
claim has no tolerations).

Limits of the model: class selectors may only be conjunctions of
`device.driver == "..."` and `device.attributes["<domain>"].<name> == "..."`
(anything else raises); the capacity already booked is what the claims the
caller passes hold; only node-local slices are looked at.
"""

import json
import random
import re
import uuid as uuidlib

EXTENDED_CLAIM_ANNOTATION = "resource.kubernetes.io/extended-resource-claim"
IMPLICIT_PREFIX = "deviceclass.resource.kubernetes.io/"
FINALIZER = "resource.kubernetes.io/delete-protection"
# The API server's SimpleNameGenerator: 5 of these after a base of at most 58.
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_MAX_GENERATE_BASE = 58


class Invalid(Exception):
    """The pod would be refused by the API server."""


class Unschedulable(Exception):
    """No node device can serve the pod's claim."""


# ---- quantities (the few forms a pod's extended resource or a capacity takes)

_QTY = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?$")
_BIN = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DEC = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def quantity(text):
    """The value of a quantity as a fractions.Fraction, or None."""
    import fractions
    m = _QTY.match(str(text))
    if not m:
        return None
    value = fractions.Fraction(m.group(1))
    suffix = m.group(2) or ""
    if suffix in _BIN:
        return value * 1024 ** _BIN[suffix]
    return value * fractions.Fraction(10) ** _DEC[suffix]


# ---- the DeviceClass an extended resource names

def class_mapping(classes):
    """{extended resource name: class} (extended/util.go, DeviceClassMapping;
    for two classes with one name, the one created later, then the name
    sorted first)."""
    mapping = {}
    order = sorted(classes, key=lambda c: (c.get("metadata", {}).get("creationTimestamp", ""),
                                           _invert(c["metadata"]["name"])))
    for c in order:  # later entries win
        name = (c.get("spec") or {}).get("extendedResourceName") or IMPLICIT_PREFIX + c["metadata"]["name"]
        mapping[name] = c
    return mapping


def _invert(text):
    # Sorting by this puts the name sorted first last, so that it wins.
    return [-ord(ch) for ch in text] + [0]


def _is_extended(name):
    """An extended resource name: a domain prefix that is not kubernetes.io
    (IsExtendedResourceName), or the implicit class prefix."""
    if name.startswith(IMPLICIT_PREFIX):
        return True
    if "/" not in name or name.startswith("requests."):
        return False
    domain = name.split("/", 1)[0]
    return not (domain == "kubernetes.io" or domain.endswith(".kubernetes.io"))


def container_requests(container, path):
    """The container's extended-resource requests {name: int} as the API
    server stores them: requests defaulted from limits, whole numbers,
    requests equal to limits (core/v1 validation for extended resources)."""
    resources = container.get("resources") or {}
    limits = resources.get("limits") or {}
    requests = dict(resources.get("requests") or {})
    out = {}
    for name in sorted(set(limits) | set(requests)):
        if not _is_extended(name):
            continue
        where = f"{path}.resources[{name}]"
        if name not in limits:
            raise Invalid(f"{where}: Required value: a limit must be set for an extended resource")
        limit = quantity(limits[name])
        request = quantity(requests.get(name, limits[name]))
        if limit is None or request is None:
            raise Invalid(f"{where}: Invalid value: not a quantity")
        if limit.denominator != 1 or request.denominator != 1:
            raise Invalid(f"{where}: Invalid value: {limits[name]}: must be an integer")
        if limit != request:
            raise Invalid(f"{where}: Invalid value: the request must equal the limit for an extended resource")
        out[name] = int(limit)
    return out


# ---- the claim the scheduler makes for the pod

def _is_sidecar(container):
    return container.get("restartPolicy") == "Always"


def _container_request(index, container, resource, class_name, reusable, creqs):
    """createResourceRequestAndMappings: (request or None, mappings)."""
    asked = creqs.get(resource, 0)
    if not asked:
        return None, []
    mappings = []
    total = 0
    for r in reusable:
        if r is None:
            continue
        total += r["exactly"]["count"]
        mappings.append({"containerName": container["name"], "resourceName": resource, "requestName": r["name"]})
        if total >= asked:
            return None, mappings
    # j: the resource's place among all of the container's requests, sorted
    # (requests as stored: defaulted from limits, so both names count).
    resources = container.get("resources") or {}
    all_requests = sorted(set(resources.get("requests") or {}) | set(resources.get("limits") or {}))
    name = f"container-{index}-request-{all_requests.index(resource)}"
    request = {"name": name, "exactly": {"deviceClassName": class_name, "allocationMode": "ExactCount",
                                          "count": asked - total}}
    mappings.append({"containerName": container["name"], "resourceName": resource, "requestName": name})
    return request, mappings


def extended_claim(pod, classes):
    """(claim, requestMappings) the scheduler makes for `pod`, or (None, [])
    when it asks for no extended resource a class stands for. The claim has
    generateName, not yet a name (the API server gives it)."""
    spec = pod.get("spec") or {}
    inits = spec.get("initContainers") or []
    containers = inits + (spec.get("containers") or [])
    creqs = [container_requests(c, f"spec.{'initContainers' if i < len(inits) else 'containers'}"
                                   f"[{i if i < len(inits) else i - len(inits)}]")
             for i, c in enumerate(containers)]
    mapping = class_mapping(classes)
    wanted = sorted({r for reqs in creqs for r, n in reqs.items() if n and r in mapping})
    if not wanted:
        return None, []
    long_lived = [i for i, c in enumerate(containers) if i >= len(inits) or _is_sidecar(c)]
    short_lived = [i for i in range(len(inits)) if not _is_sidecar(containers[i])]
    requests, mappings = [], []
    for resource in wanted:
        class_name = mapping[resource]["metadata"]["name"]
        long_requests = [None] * len(containers)
        long_mappings, short_mappings = [], []
        for i in long_lived:
            r, m = _container_request(i, containers[i], resource, class_name, [], creqs[i])
            long_requests[i] = r
            long_mappings += m
        largest, short_names = None, set()
        for i in short_lived:
            r, m = _container_request(i, containers[i], resource, class_name, long_requests[i:], creqs[i])
            if r is not None:
                short_names.add(r["name"])
                if largest is None or largest["exactly"]["count"] < r["exactly"]["count"]:
                    largest = r
            short_mappings += m
        if largest is not None and len(short_names) > 1:
            for m in short_mappings:
                if m["requestName"] in short_names:
                    m["requestName"] = largest["name"]
        if largest is not None:
            requests.append(largest)
        requests += [r for r in long_requests if r is not None]
        mappings += long_mappings + short_mappings
    requests.sort(key=lambda r: r["name"])
    meta = pod["metadata"]
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "namespace": meta.get("namespace", "default"),
            "generateName": meta["name"] + "-extended-resources-",
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"],
                                 "controller": True}],
            "annotations": {EXTENDED_CLAIM_ANNOTATION: "true"},
        },
        "spec": {"devices": {"requests": requests}},
    }
    return claim, mappings


def generate_name(base, rng=random):
    """The API server's name for generateName `base`."""
    return base[:_MAX_GENERATE_BASE] + "".join(rng.choice(_NAME_ALPHABET) for _ in range(5))


# ---- booking devices for it

_TERM = re.compile(r'^device\.driver\s*==\s*"([^"]*)"$|'
                   r'^device\.attributes\["([^"]+)"\]\.([A-Za-z_][A-Za-z0-9_]*)\s*==\s*"([^"]*)"$')


def _selects(expression, driver, device):
    for term in expression.split("&&"):
        m = _TERM.match(term.strip())
        if not m:
            raise ValueError(f"the stand-in scheduler cannot evaluate the CEL expression {expression!r}")
        if m.group(1) is not None:
            if driver != m.group(1):
                return False
        else:
            domain, name, value = m.group(2), m.group(3), m.group(4)
            attr = (device.get("attributes") or {}).get(name) if domain == driver else None
            if not attr or attr.get("string") != value:
                return False
    return True


def _consumed(device, asked):
    """What a request books on `device` (GetConsumedCapacityFromRequest): a
    capacity it names, what it asks (the policy's rounding is left to
    tests/k8s_manifests, which checks the examples are not rounded); one it
    does not name, the policy's default, else the whole value."""
    out = {}
    for name, capacity in (device.get("capacity") or {}).items():
        policy = capacity.get("requestPolicy") or {}
        out[name] = asked.get(name, policy.get("default", capacity["value"]))
    return out


def template_claim(pod, pod_claim, template):
    """The claim the resourceclaim controller makes for a pod's
    resourceClaims entry naming a ResourceClaimTemplate
    (pkg/controller/resourceclaim/controller.go, handleClaim): generateName
    "<pod>-<entry>-", the annotation resource.kubernetes.io/pod-claim-name,
    the pod as controlling owner (blockOwnerDeletion too), the template's
    spec. (The pod's status.resourceClaimStatuses then names it.)"""
    meta = pod["metadata"]
    tmeta = template.get("spec", {}).get("metadata") or {}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "namespace": meta.get("namespace", "default"),
            "generateName": meta["name"] + "-" + pod_claim + "-",
            "labels": dict(tmeta.get("labels") or {}),
            "annotations": dict(tmeta.get("annotations") or {}, **{"resource.kubernetes.io/pod-claim-name": pod_claim}),
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"],
                                 "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": json.loads(json.dumps(template["spec"]["spec"])),
    }


def booked_on(claims):
    """{(driver, pool, device): {capacity: Fraction}} the allocated claims hold."""
    import fractions
    held = {}
    for c in claims:
        for r in (((c.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []:
            key = (r.get("driver"), r.get("pool"), r.get("device"))
            for name, q in (r.get("consumedCapacity") or {}).items():
                held.setdefault(key, {}).setdefault(name, fractions.Fraction(0))
                held[key][name] += quantity(q) or 0
    return held


def allocate(claim, classes, slices, node, held):
    """status.allocation for `claim` on `node`'s devices (the slices whose
    spec.nodeName is `node`), given what other claims hold; raises
    Unschedulable when a request cannot be served."""
    by_name = {c["metadata"]["name"]: c for c in classes}
    candidates = []
    for s in slices:
        sp = s.get("spec") or {}
        if sp.get("nodeName") != node:
            continue
        for d in sp.get("devices") or []:
            candidates.append((sp["driver"], sp["pool"]["name"], d))
    taking = {}  # what this claim books, device key -> {capacity: Fraction}
    results, config = [], []
    constraints = claim["spec"]["devices"].get("constraints") or []
    distinct = [(set(c.get("requests") or []), c["distinctAttribute"], set())
                for c in constraints if c.get("distinctAttribute")]
    if len(distinct) != len(constraints):
        raise ValueError("the stand-in scheduler models only distinctAttribute constraints")
    for request in claim["spec"]["devices"]["requests"]:
        if "exactly" not in request:
            raise ValueError("the stand-in scheduler models only exactly requests")
        exact = request["exactly"]
        if exact.get("allocationMode", "ExactCount") != "ExactCount" or exact.get("selectors") \
                or exact.get("tolerations") or exact.get("adminAccess"):
            raise ValueError("the stand-in scheduler models ExactCount requests without selectors, "
                             "tolerations or adminAccess")
        asked = (exact.get("capacity") or {}).get("requests") or {}
        cls = by_name.get(exact["deviceClassName"])
        if cls is None:
            raise Unschedulable(f"request {request['name']}: deviceclass {exact['deviceClassName']} not found")
        got, count = 0, exact.get("count", 1)
        for driver, pool, device in candidates:
            if got == count:
                break
            applying = [(attr, seen) for names, attr, seen in distinct if not names or request["name"] in names]
            values = []
            for attr, seen in applying:
                domain, _, name = attr.partition("/")
                value = json.dumps(((device.get("attributes") or {}).get(name) if domain == driver else None))
                values.append(value)
            if any(v == "null" or v in seen for v, (_, seen) in zip(values, applying)):
                continue
            if any(t.get("effect") in ("NoSchedule", "NoExecute") for t in device.get("taints") or []):
                continue
            if not all(_selects(s["cel"]["expression"], driver, device) for s in cls["spec"].get("selectors") or []):
                continue
            key = (driver, pool, device["name"])
            wants = _consumed(device, asked)
            multiple = device.get("allowMultipleAllocations", False)
            if not multiple and (key in held or key in taking):
                continue
            fits = True
            for name, q in wants.items():
                value = quantity(device["capacity"][name]["value"])
                used = held.get(key, {}).get(name, 0) + taking.get(key, {}).get(name, 0)
                fits = fits and used + quantity(q) <= value
            if not fits:
                continue
            for name, q in wants.items():
                taking.setdefault(key, {}).setdefault(name, 0)
                taking[key][name] += quantity(q)
            result = {"request": request["name"], "driver": driver, "pool": pool, "device": device["name"]}
            if multiple:
                result["consumedCapacity"] = wants
                result["shareID"] = str(uuidlib.uuid4())
            results.append(result)
            for v, (_, seen) in zip(values, applying):
                seen.add(v)
            got += 1
        if got < count:
            raise Unschedulable(f"request {request['name']}: {got} of {count} device(s) of class "
                                f"{cls['metadata']['name']} free on node {node}")
        for c in cls["spec"].get("config") or []:
            config.append(dict(c, source="FromClass", requests=[request["name"]]))
    # The claim's own config after the classes' (allocator.go: FromClaim).
    for c in claim["spec"]["devices"].get("config") or []:
        config.append(dict(c, source="FromClaim"))
    return {
        "devices": {"results": results, "config": config},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
    }


def _allocated(claim, allocation, pod, now, rng):
    meta = claim["metadata"]
    meta["name"] = generate_name(meta["generateName"], rng)
    meta["uid"] = str(uuidlib.uuid4())
    meta["creationTimestamp"] = now
    meta["finalizers"] = [FINALIZER]
    claim["status"] = {"allocation": allocation,
                       "reservedFor": [{"resource": "pods", "name": pod["metadata"]["name"],
                                        "uid": pod["metadata"]["uid"]}]}
    return json.loads(json.dumps(claim))


def schedule(pod, classes, slices, node, claims, now, templates=(), rng=random):
    """The claims of `pod` bound to `node` as stored once it is bound, and
    the pod's status patch: one claim per resourceClaims entry naming a
    template (from `templates`), then the claim for its extended resources,
    if any. `claims`: those already allocated (their capacity is taken)."""
    spec = pod.get("spec") or {}
    by_template = {t["metadata"]["name"]: t for t in templates}
    held = booked_on(claims)
    made, status = [], {}
    for entry in spec.get("resourceClaims") or []:
        template = by_template.get(entry.get("resourceClaimTemplateName"))
        if template is None:
            raise Unschedulable(f"resourceClaims {entry.get('name')}: no such template among those given")
        claim = template_claim(pod, entry["name"], template)
        allocation = allocate(claim, classes, slices, node, held)
        made.append(_allocated(claim, allocation, pod, now, rng))
        held = booked_on(list(claims) + made)
        status.setdefault("resourceClaimStatuses", []).append(
            {"name": entry["name"], "resourceClaimName": made[-1]["metadata"]["name"]})
    claim, mappings = extended_claim(pod, classes)
    if claim is not None:
        allocation = allocate(claim, classes, slices, node, held)
        made.append(_allocated(claim, allocation, pod, now, rng))
        status["extendedResourceClaimStatus"] = {"requestMappings": mappings,
                                                 "resourceClaimName": made[-1]["metadata"]["name"]}
    return made, status
