#!/usr/bin/env python3
"""A stand-in Kubernetes API server for tests (Python 3 standard library only).

It serves what fracgpu's kubelet plugin uses of resource.k8s.io/v1:
ResourceClaims (read from fixture files) and ResourceSlices (kept in memory,
with resourceVersions, conflicts, field selectors), checks bearer tokens or
client certificates, records every ResourceSlice write to a log file, and can
be told to fail requests. ResourceSlices written to it are checked against the
v1 validation rules (resource/v1 types.go and the API server's validation), as
the real server does: an invalid one is refused with 422 and the reasons.

Command line
  fake_apiserver.py --port-file FILE --log FILE [options]

  --port-file FILE   written once listening: the port, then a newline (the file
                     appears whole: written aside and renamed). Wait for it.
  --log FILE         one JSON object per line for every ResourceSlice write:
                     {"seq", "verb": "create"|"update"|"delete", "name",
                      "status": <HTTP status>, "body": <request body or null>,
                      "object": <object as stored, or null>}
  --fixtures DIR     ResourceClaims: GET /apis/resource.k8s.io/v1/namespaces/NS/
                     resourceclaims/NAME answers DIR/NS/NAME.json, read at each
                     request (tests may add, change or remove files any time).
  --tls-dir DIR      serve HTTPS with DIR/server.crt + DIR/server.key, made with
                     the openssl CLI (with DIR/ca.crt, the CA that signs them,
                     and DIR/client.crt + DIR/client.key, a client certificate
                     signed by the same CA) unless DIR/server.crt exists.
                     Clients trust DIR/ca.crt. The server certificate names
                     localhost, 127.0.0.1 and ::1. Without --tls-dir: plain HTTP.
  --host ADDR        address to listen on (127.0.0.1; "::1" for IPv6).
  --token TOKEN      a bearer token to accept (repeatable).
  --token-file FILE  accept the token in FILE, re-read at each request.
  --client-ca FILE   accept clients whose certificate FILE's CA signed.
                     With none of --token, --token-file, --client-ca every
                     request is accepted; otherwise others get 401.
  --fail SPEC        METHOD:PATH_REGEX:STATUS:COUNT[:RETRY_AFTER] - the next
                     COUNT requests whose method and path (re.search, query
                     included) match are answered STATUS with a Status body
                     (and a Retry-After header if given). Repeatable.
  --no-canonical     keep quantities as written (by default they are stored in
                     the API server's canonical form: "1000m" -> "1",
                     "16000000000" -> "16G", "1024Mi" -> "1Gi").
  --gc-delay SECONDS
                     how long after a change the garbage collector (below)
                     looks at the objects it concerns (0.1).
  --feature-gates DRADeviceTaints=false
                     as an API server with that gate off (Kubernetes 1.33 to
                     1.35 by default): a device's "taints" is dropped from
                     every ResourceSlice written, before validation, as the
                     real server drops fields of disabled features. On by
                     default (as from 1.36).

Control, at run time (loopback, no authentication):
  POST /fake/fail     {"method": "PUT", "path": "resourceslices", "status": 409,
                       "count": 1, "retry_after": 1, "message": "..."}; with
                       "delay": SECONDS the request waits that long first, and
                       without "status" is then served as usual (a slow server)
  POST /fake/reset    forget pending failures and the request record
  POST /fake/tokens   {"tokens": [...]}: the accepted --token list from now on
  GET  /fake/requests every request so far, recorded before its answer is sent:
                      [{"method", "path", "status",
                       "authorized"}], for counting attempts
  GET  /fake/slices   every stored ResourceSlice
  POST /fake/delete-node {"name": NODE}: the Node is deleted (404 if it does
                      not exist); answers {"uid": its uid, "dependents":
                      [names of the slices whose ownerReferences name it]},
                      which the garbage collector deletes (below)
  POST /fake/create-node {"name": NODE}: the Node is created with a new uid
                      (409 if it exists); answers {"uid": the new uid}. A
                      deleted and re-created Node, as `kubectl delete node`
                      and a kubelet registering again make
  POST /fake/rbac     {"rules": [ClusterRole rules], "node": NODE}: from now on
                      the API requests (not these control paths) are
                      authorized by those rules, as RBAC does (verb, group,
                      resource/subresource, resourceNames), the caller's
                      service-account token bound to NODE; a status.devices
                      write also needs the 1.36 granular permission on
                      resourceclaims/driver (associated-node:<verb> for claims
                      allocated on NODE, else arbitrary-node:<verb>). Refused:
                      403. {"rules": null}: everything allowed (the default)
  POST /fake/schedule {"pod": POD, "node": NODE, "deviceClasses": [...],
                      "claimTemplates": [...]}: the pod bound to NODE with
                      its claims (fake_scheduler.py): one made from each
                      template its resourceClaims name, as the resourceclaim
                      controller makes it, and the one the kube-scheduler
                      makes for extended resources a DeviceClass stands for,
                      each allocated on NODE's stored slices (given what the
                      --fixtures claims hold) and written to --fixtures
                      (served from then on); answered {"claims", "pod"} (the
                      pod with nodeName, status.resourceClaimStatuses and
                      status.extendedResourceClaimStatus); 422 for a pod the
                      API server refuses, 409 when something does not fit
  POST /fake/forget-claim {"namespace": NS, "name": NAME}: deletes that
                      --fixtures claim, under the lock its status writes
                      take (a test deleting the file itself could race a
                      status write and see the claim come back)
  POST /fake/gc       {"delay": SECONDS}: as --gc-delay, from now on
  POST /fake/feature-gates {"DRADeviceTaints": false}: as --feature-gates,
                      for the writes from now on

Nodes (GET /api/v1/nodes/NAME) all exist, each with a uid stable for its
name, until deleted; a Node created again has a new uid.

The garbage collector, as the real one (kube-controller-manager's
garbagecollector: attemptToDeleteItem, isDangling): an owner reference is
dangling when no object of that kind and name exists or the one that exists
has another uid; an object whose owner references are all dangling is
deleted, and one with some dangling and some not loses the dangling ones.
It looks at a ResourceSlice --gc-delay seconds (default 0.1; the real one
whenever its work queue gets to it) after it was created or its
ownerReferences changed, and at a Node's dependents that long after the Node
was deleted, judging the objects as they are then. Only Node owners
(apiVersion v1) are judged; references to kinds this server does not serve
are left alone, as the real collector leaves kinds it cannot resolve. Its
writes are in the --log file with "by": "garbage-collector".

Also: fake_apiserver.py --check-slice FILE... validates ResourceSlice JSON
files and prints the errors (exit 1 if any).

ResourceClaim status (PATCH /apis/resource.k8s.io/v1/namespaces/NS/
resourceclaims/NAME/status, server-side apply only): the field manager's
status.devices entries replace those it applied before, others' stay; the
claim is checked as the 1.36 API server checks device statuses (each an
allocated device of the claim, conditions, data a JSON object up to 10 Ki)
and against the 1.36 schema, then written back to its --fixtures file. A
metadata.uid that is not the claim's: 409.

The other kinds deploy/ and deploy/examples/ hold (KINDS below: Namespace,
ConfigMap, ServiceAccount, Pod, DaemonSet, Deployment, Job, RBAC roles and
bindings, ValidatingAdmissionPolicy and its binding, DeviceClass,
ResourceClaimTemplate) are served at their API paths: create (POST), apply
(PATCH, application/apply-patch+yaml, fieldManager required), get, delete,
and discovery (GET /api/v1, /apis/GROUP/VERSION). Every write, these and
the ResourceSlice and claim status writes above, takes ?dryRun=All: checked,
defaulted and admitted as the real write, answered as it would be stored,
stored nowhere (not in the --log file either); another dryRun value is
refused with 422 as upstream refuses it. What is modelled of each kind: the
comment above KINDS.

It is stricter than the API server in one way: unknown fields in a
ResourceSlice are refused (the real server drops them with a warning), so a
misspelt field fails a test instead of vanishing.
"""

import argparse
import datetime
import decimal
import http.server
import json
import os
import random
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid as uuidlib

import fake_scheduler  # beside this file: the kube-scheduler's claim for extended resources

API_PREFIX = "/apis/resource.k8s.io/v1"

# ---------------------------------------------------------------- quantities

decimal.getcontext().prec = 60

_QUANTITY_RE = re.compile(
    r"^([+-]?)(\d+\.?\d*|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|[eE][+-]?\d+|[numkMGTPE])?$")
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_SUFFIX = {v: k for k, v in _DECIMAL.items()}


def parse_quantity(text):
    """(Decimal value rounded up to 1n, format) or None. format: binary|decimal|exponent."""
    if not isinstance(text, str):
        return None
    m = _QUANTITY_RE.match(text)
    if not m:
        return None
    sign, number, suffix = m.group(1), m.group(2), m.group(3) or ""
    value = decimal.Decimal(number)
    if suffix in _BINARY:
        value *= decimal.Decimal(1024) ** _BINARY[suffix]
        fmt = "binary"
    elif suffix[:1] in ("e", "E") and len(suffix) > 1:
        value = value.scaleb(int(suffix[1:]))
        fmt = "exponent"
    else:
        value = value.scaleb(_DECIMAL[suffix])
        fmt = "decimal"
    # The API server keeps nothing finer than 1n and rounds up.
    value = value.quantize(decimal.Decimal("1e-9"), rounding=decimal.ROUND_CEILING)
    if sign == "-":
        value = -value
    return value, fmt


def quantity_value(q):
    """Quantity.Value(): rounded up to an integer."""
    return int(q.to_integral_value(rounding=decimal.ROUND_CEILING))


def canonical_quantity(text):
    """The API server's canonical form for the common cases."""
    parsed = parse_quantity(text)
    if parsed is None:
        return text
    value, fmt = parsed
    if value == 0:
        return "0"
    sign = "-" if value < 0 else ""
    magnitude = abs(value)
    if fmt == "binary" and magnitude == magnitude.to_integral_value() and magnitude >= 1024:
        n, power = int(magnitude), 0
        while power < 6 and n % 1024 == 0:
            n //= 1024
            power += 1
        return sign + str(n) + ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"][power]
    # Decimal SI: the largest exponent (a multiple of 3) leaving an integer.
    for exponent in range(18, -12, -3):
        scaled = magnitude.scaleb(-exponent)
        if scaled == scaled.to_integral_value():
            return sign + str(int(scaled)) + _DECIMAL_SUFFIX[exponent]
    return text


# ---------------------------------------------------------- v1 validation

_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_C_IDENTIFIER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SEMVER_RE = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(-(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(\.(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*)?"
    r"(\+[0-9a-zA-Z-]+(\.[0-9a-zA-Z-]+)*)?$")

MAX_DEVICES = 128
MAX_DEVICES_ADVANCED = 64
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_ATTRIBUTE_VALUE_LENGTH = 64
MAX_ID_LENGTH = 32
MAX_DOMAIN_LENGTH = 63
MAX_VALID_VALUES = 10

_SLICE_FIELDS = {"apiVersion", "kind", "metadata", "spec"}
_SPEC_FIELDS = {"driver", "pool", "nodeName", "nodeSelector", "allNodes", "devices",
                "perDeviceNodeSelection", "sharedCounters", "partitionTypeAttribute",
                "skipNodeOperations"}
_POOL_FIELDS = {"name", "generation", "resourceSliceCount"}
_DEVICE_FIELDS = {"name", "attributes", "capacity", "consumesCounters", "nodeName", "nodeSelector",
                  "allNodes", "taints", "bindsToNode", "bindingConditions",
                  "bindingFailureConditions", "allowMultipleAllocations", "nodeAllocatableResources"}
_ATTRIBUTE_FIELDS = {"int", "bool", "string", "version", "ints", "bools", "strings", "versions"}
_CAPACITY_FIELDS = {"value", "requestPolicy"}
_POLICY_FIELDS = {"default", "validValues", "validRange"}
_RANGE_FIELDS = {"min", "max", "step"}


def _dns_subdomain(name, max_length=253):
    return isinstance(name, str) and 0 < len(name) <= max_length and bool(_DNS_SUBDOMAIN_RE.match(name))


def _prefix_and_name(text):
    """"prefix/name" or "name" as (prefix or None, name); None for more than one "/"."""
    parts = text.split("/")
    if len(parts) > 2:
        return None
    return (parts[0] if len(parts) == 2 else None), parts[-1]


def _qualified_name(name):
    if not isinstance(name, str) or not name:
        return "must not be empty"
    split = _prefix_and_name(name)
    if split is None:
        return "must be a C identifier or a domain/C identifier"
    domain, ident = split
    if domain is not None and not _dns_subdomain(domain, MAX_DOMAIN_LENGTH):
        return "the domain must be a DNS subdomain of at most %d characters" % MAX_DOMAIN_LENGTH
    if not _C_IDENTIFIER_RE.match(ident):
        return "must be a C identifier"
    if len(ident) > MAX_ID_LENGTH:
        return "the identifier must be at most %d characters" % MAX_ID_LENGTH
    return None


# Label keys and values (apimachinery's IsQualifiedName, IsValidLabelValue).
_LABEL_NAME_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_RFC3339_RE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$")
MAX_LABEL_NAME_LENGTH = 63
MAX_LABEL_VALUE_LENGTH = 63
MAX_TAINTS_PER_DEVICE = 16  # resource/v1 DeviceTaintsMaxLength
# resource/v1 DeviceTaintEffect: NoSchedule, NoExecute, and None (informational) in newer versions.
TAINT_EFFECTS = {"None", "NoSchedule", "NoExecute"}
_TAINT_FIELDS = {"key", "value", "effect", "timeAdded"}


def _label_name(key):
    """Why `key` is not a qualified name as label keys are (None: it is)."""
    if not isinstance(key, str) or not key:
        return "name part must be non-empty"
    split = _prefix_and_name(key)
    if split is None:
        return "a qualified name must consist of an optional DNS subdomain prefix and '/' and a name"
    prefix, name = split
    if prefix is not None and not _dns_subdomain(prefix):
        return "prefix part must be a DNS subdomain of at most 253 characters"
    if not name or len(name) > MAX_LABEL_NAME_LENGTH or not _LABEL_NAME_RE.match(name):
        return ("name part must consist of alphanumeric characters, '-', '_' or '.', start and end with an "
                "alphanumeric character, and be at most %d characters" % MAX_LABEL_NAME_LENGTH)
    return None


def _validate_taints(taints, path, errors):
    if not isinstance(taints, list):
        errors.append(path + ": must be a list")
        return
    if len(taints) > MAX_TAINTS_PER_DEVICE:
        errors.append("%s: Too many: %d: must have at most %d items" % (path, len(taints), MAX_TAINTS_PER_DEVICE))
        return
    for i, taint in enumerate(taints):
        tpath = "%s[%d]" % (path, i)
        if not isinstance(taint, dict):
            errors.append(tpath + ": must be an object")
            continue
        _unknown(taint, _TAINT_FIELDS, tpath, errors)
        problem = _label_name(taint.get("key"))
        if problem:
            errors.append("%s.key: Invalid value: %r: %s" % (tpath, taint.get("key"), problem))
        value = taint.get("value", "")
        if not (isinstance(value, str) and len(value) <= MAX_LABEL_VALUE_LENGTH and _LABEL_VALUE_RE.match(value)):
            errors.append("%s.value: Invalid value: %r: a valid label value must be at most %d characters of "
                          "alphanumerics, '-', '_' or '.', starting and ending with an alphanumeric"
                          % (tpath, value, MAX_LABEL_VALUE_LENGTH))
        effect = taint.get("effect")
        if effect is None or effect == "":
            errors.append(tpath + ".effect: Required value")
        elif effect not in TAINT_EFFECTS:
            errors.append("%s.effect: Unsupported value: %r: supported values: %s"
                          % (tpath, effect, ", ".join('"%s"' % e for e in sorted(TAINT_EFFECTS))))
        added = taint.get("timeAdded")
        if added is not None and not (isinstance(added, str) and _RFC3339_RE.match(added)):
            errors.append("%s.timeAdded: not an RFC 3339 time: %r" % (tpath, added))


def _unknown(obj, known, path, errors):
    for key in obj:
        if key not in known:
            errors.append("%s.%s: unknown field" % (path, key))


def _map_entry(key, value, known, path, errors):
    """An attribute or capacity: a qualified name for an object of known fields."""
    problem = _qualified_name(key)
    if problem:
        errors.append(path + ": " + problem)
    if not isinstance(value, dict):
        errors.append(path + ": must be an object")
        return False
    _unknown(value, known, path, errors)
    return True


def _validate_request_policy(value, policy, path, errors):
    if not isinstance(policy, dict):
        errors.append(path + ": must be an object")
        return
    _unknown(policy, _POLICY_FIELDS, path, errors)
    default = policy.get("default")
    parsed_default = None
    if default is not None:
        parsed_default = parse_quantity(default)
        if parsed_default is None:
            errors.append(path + ".default: not a quantity: %r" % (default,))
            return
        parsed_default = parsed_default[0]
    valid_values = policy.get("validValues")
    valid_range = policy.get("validRange")
    if valid_values and valid_range is not None:
        errors.append(path + ': exactly one policy can be specified, not "validValues" and "validRange"')
        return
    if valid_values:
        if parsed_default is None:
            errors.append(path + ".default: required when validValues is defined")
            return
        if len(valid_values) > MAX_VALID_VALUES:
            errors.append(path + ".validValues: at most %d entries" % MAX_VALID_VALUES)
        options = []
        for i, option in enumerate(valid_values):
            parsed = parse_quantity(option)
            if parsed is None:
                errors.append("%s.validValues[%d]: not a quantity" % (path, i))
                return
            if parsed[0] > value:
                errors.append("%s.validValues[%d]: option is larger than capacity value" % (path, i))
            options.append(parsed[0])
        if options != sorted(options):
            errors.append(path + ".validValues: values must be sorted in ascending order")
        if parsed_default not in options:
            errors.append(path + ".validValues: default value is not valid according to the requestPolicy")
    elif valid_range is not None:
        rpath = path + ".validRange"
        if not isinstance(valid_range, dict):
            errors.append(rpath + ": must be an object")
            return
        _unknown(valid_range, _RANGE_FIELDS, rpath, errors)
        if parsed_default is None:
            errors.append(path + ".default: required when validRange is defined")
            return
        bounds = {}
        for key in ("min", "max", "step"):
            if key in valid_range and valid_range[key] is not None:
                parsed = parse_quantity(valid_range[key])
                if parsed is None:
                    errors.append("%s.%s: not a quantity: %r" % (rpath, key, valid_range[key]))
                    return
                bounds[key] = parsed[0]
        if "min" not in bounds:
            errors.append(rpath + ".min: required when validRange is defined")
            return
        low = bounds["min"]
        if low > value:
            errors.append(rpath + ".min: min is larger than capacity value")
        if parsed_default < low:
            errors.append(rpath + ".min: default is less than min")
        if "max" in bounds:
            if low > bounds["max"]:
                errors.append(rpath + ".max: min is larger than max")
            if bounds["max"] > value:
                errors.append(rpath + ".max: max is larger than capacity value")
            if parsed_default > bounds["max"]:
                errors.append(rpath + ".max: default is more than max")
        if "step" in bounds:
            step = bounds["step"]
            if low + step > value:
                errors.append(rpath + ".step: one step is larger than capacity value")
            # Integer arithmetic (Quantity.Value()), as servers without
            # DRAFractionalCapacityRange check it.
            step_int, min_int = quantity_value(step), quantity_value(low)
            if step_int <= 0:
                errors.append(rpath + ".step: must be positive")
                return
            for name, q in (("default", parsed_default), ("max", bounds.get("max"))):
                if q is not None and (quantity_value(q) - min_int) % step_int != 0:
                    errors.append("%s.step: %s is not a multiple of the step from min" % (rpath, name))


def _validate_device(device, path, errors):
    if not isinstance(device, dict):
        errors.append(path + ": must be an object")
        return
    _unknown(device, _DEVICE_FIELDS, path, errors)
    name = device.get("name")
    if not (isinstance(name, str) and len(name) <= 63 and _DNS_LABEL_RE.match(name)):
        errors.append(path + ".name: must be a DNS label: %r" % (name,))
    attributes = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    if not isinstance(attributes, dict) or not isinstance(capacity, dict):
        errors.append(path + ": attributes and capacity must be objects")
        return
    if len(attributes) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        errors.append(path + ": the total number of attributes and capacities must not exceed %d"
                      % MAX_ATTRIBUTES_AND_CAPACITIES)
    for key, attribute in attributes.items():
        apath = "%s.attributes[%s]" % (path, key)
        if not _map_entry(key, attribute, _ATTRIBUTE_FIELDS, apath, errors):
            continue
        if len(attribute) != 1:
            errors.append(apath + ": exactly one value must be specified")
            continue
        kind, v = next(iter(attribute.items()))
        if kind == "int" and not (isinstance(v, int) and not isinstance(v, bool) and -2**63 <= v < 2**63):
            errors.append(apath + ".int: not a 64-bit integer")
        elif kind == "bool" and not isinstance(v, bool):
            errors.append(apath + ".bool: not a boolean")
        elif kind == "string" and not (isinstance(v, str) and len(v.encode()) <= MAX_ATTRIBUTE_VALUE_LENGTH):
            errors.append(apath + ".string: not a string of at most %d bytes" % MAX_ATTRIBUTE_VALUE_LENGTH)
        elif kind == "version" and not (isinstance(v, str) and len(v) <= MAX_ATTRIBUTE_VALUE_LENGTH
                                        and _SEMVER_RE.match(v)):
            errors.append(apath + ".version: must be a string compatible with semver.org spec 2.0.0: %r" % (v,))
    if device.get("taints") is not None:
        _validate_taints(device["taints"], path + ".taints", errors)
    multiple = device.get("allowMultipleAllocations") is True
    for key, cap in capacity.items():
        cpath = "%s.capacity[%s]" % (path, key)
        if not _map_entry(key, cap, _CAPACITY_FIELDS, cpath, errors):
            continue
        parsed = parse_quantity(cap.get("value"))
        if parsed is None:
            errors.append(cpath + ".value: not a quantity: %r" % (cap.get("value"),))
            continue
        if cap.get("requestPolicy") is not None:
            if not multiple:
                errors.append(cpath + ".requestPolicy: allowMultipleAllocations must be true")
            else:
                _validate_request_policy(parsed[0], cap["requestPolicy"], cpath + ".requestPolicy", errors)


def node_uid(name):
    """A node's uid in this stand-in: stable for its name."""
    return str(uuidlib.uuid5(uuidlib.NAMESPACE_DNS, "node." + name))


def validate_owner_references(meta, errors):
    """metadata.ownerReferences as the API server's ObjectMeta validation checks them."""
    refs = meta.get("ownerReferences")
    if refs is None:
        return
    if not isinstance(refs, list):
        errors.append("metadata.ownerReferences: must be a list")
        return
    controllers = 0
    for i, ref in enumerate(refs):
        where = "metadata.ownerReferences[%d]" % i
        if not isinstance(ref, dict):
            errors.append(where + ": must be an object")
            continue
        for key in ("apiVersion", "kind", "name", "uid"):
            if not isinstance(ref.get(key), str) or not ref.get(key):
                errors.append("%s.%s: Required value" % (where, key))
        for key in ("controller", "blockOwnerDeletion"):
            if key in ref and not isinstance(ref[key], bool):
                errors.append("%s.%s: must be a boolean" % (where, key))
        controllers += 1 if ref.get("controller") is True else 0
        unknown = set(ref) - {"apiVersion", "kind", "name", "uid", "controller", "blockOwnerDeletion"}
        if unknown:
            errors.append("%s: unknown field(s) %s" % (where, ", ".join(sorted(unknown))))
    if controllers > 1:
        errors.append("metadata.ownerReferences: Only one reference can have Controller set to true")


# The resource.k8s.io/v1 schema of the Kubernetes version under test, as
# kubernetes-validate ships it (scripts/install-deps.sh installs it): every
# slice the plugin writes is checked against it too, strictly (unknown
# fields refused), so a shape the real API server's schema refuses fails a
# test even where the hand-written checks below miss it. Without the
# package only the hand-written checks run (said once on stderr).
SCHEMA_VERSION = "1.36.0"
_schema_warned = []


def schema_errors(obj):
    try:
        import kubernetes_validate.utils as kv
    except ImportError as e:
        if not _schema_warned:
            sys.stderr.write("fake_apiserver: kubernetes-validate not importable (%s): schema checks off\n" % e)
            _schema_warned.append(True)
        return []
    try:
        kv.validate(obj, SCHEMA_VERSION, strict=True)
    except kv.ValidationError as e:
        path = ".".join(str(p) for p in e.path)
        return ["%s: %s (schema of Kubernetes %s)" % (path or "(object)", e.message, SCHEMA_VERSION)]
    except kv.SchemaNotFoundError as e:
        return ["no schema: %s" % e]
    except Exception as e:  # what the real server would refuse as undecodable, not a crash here
        return ["(object): not valid: %r" % (e,)]
    return []


def validate_resource_slice(obj):
    """The reasons the v1 API would refuse `obj` (empty: valid)."""
    errors = []
    if not isinstance(obj, dict):
        return ["must be an object"]
    errors += schema_errors(obj)
    validate_owner_references(obj.get("metadata") or {}, errors)
    _unknown(obj, _SLICE_FIELDS, "", errors)
    if obj.get("apiVersion") != "resource.k8s.io/v1" or obj.get("kind") != "ResourceSlice":
        errors.append("apiVersion/kind: must be resource.k8s.io/v1 ResourceSlice")
    name = (obj.get("metadata") or {}).get("name")
    if not _dns_subdomain(name):
        errors.append("metadata.name: must be a DNS subdomain of at most 253 characters: %r" % (name,))
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return errors + ["spec: required"]
    _unknown(spec, _SPEC_FIELDS, "spec", errors)
    if not _dns_subdomain(spec.get("driver"), 63):
        errors.append("spec.driver: must be a DNS subdomain of at most 63 characters")
    pool = spec.get("pool")
    if not isinstance(pool, dict):
        errors.append("spec.pool: required")
    else:
        _unknown(pool, _POOL_FIELDS, "spec.pool", errors)
        pool_name = pool.get("name")
        if not (isinstance(pool_name, str) and 0 < len(pool_name) <= 253
                and all(_dns_subdomain(p) for p in pool_name.split("/"))):
            errors.append("spec.pool.name: must be DNS subdomains separated by slashes, at most 253 characters")
        generation = pool.get("generation")
        if not (isinstance(generation, int) and not isinstance(generation, bool) and 0 <= generation < 2**63):
            errors.append("spec.pool.generation: must be an integer >= 0")
        count = pool.get("resourceSliceCount")
        if not (isinstance(count, int) and not isinstance(count, bool) and count > 0):
            errors.append("spec.pool.resourceSliceCount: must be greater than zero")
    selections = [k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")
                  if spec.get(k) not in (None, False, "")]
    if len(selections) != 1:
        errors.append("spec: exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection is required")
    if "nodeName" in spec and not _dns_subdomain(spec["nodeName"]):
        errors.append("spec.nodeName: must be a DNS subdomain")
    devices = spec.get("devices") or []
    if not isinstance(devices, list):
        return errors + ["spec.devices: must be a list"]
    advanced = any(isinstance(d, dict) and (d.get("taints") or d.get("consumesCounters")) for d in devices)
    limit = MAX_DEVICES_ADVANCED if advanced else MAX_DEVICES
    if len(devices) > limit:
        return errors + ["spec.devices: must have at most %d items" % limit]
    seen = set()
    for i, device in enumerate(devices):
        _validate_device(device, "spec.devices[%d]" % i, errors)
        name = device.get("name") if isinstance(device, dict) else None
        if name in seen:
            errors.append("spec.devices[%d].name: duplicate %r" % (i, name))
        seen.add(name)
    return errors


# resource/v1 AllocatedDeviceStatus as the API server validates it
# (pkg/apis/resource/validation: validateDeviceStatus, and metav1's
# ValidateConditions): each entry an allocated device of the claim, at most
# one entry per device, at most 8 conditions with unique types, data a JSON
# object of at most 10 Ki.
_CONDITION_REASON_RE = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
_UID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
MAX_DEVICE_STATUS_CONDITIONS = 8
MAX_DEVICE_STATUS_DATA = 10 * 1024


def validate_device_statuses(devices, allocation):
    errors = []
    allocated = set()
    for r in ((allocation or {}).get("devices") or {}).get("results") or []:
        allocated.add((r.get("driver"), r.get("pool"), r.get("device"), r.get("shareID")))
    seen = set()
    for i, d in enumerate(devices):
        where = "status.devices[%d]" % i
        for field in ("driver", "pool", "device"):
            if not isinstance(d.get(field), str) or not d.get(field):
                errors.append("%s.%s: Required value" % (where, field))
        if isinstance(d.get("driver"), str) and d.get("driver") and not _dns_subdomain(d["driver"]):
            errors.append("%s.driver: Invalid value: %r: a lowercase RFC 1123 subdomain" % (where, d["driver"]))
        if isinstance(d.get("device"), str) and d.get("device") and not _DNS_LABEL_RE.match(d["device"]):
            errors.append("%s.device: Invalid value: %r: a DNS label" % (where, d["device"]))
        if d.get("shareID") is not None and not _UID_RE.match(str(d["shareID"])):
            errors.append("%s.shareID: Invalid value: %r: a lowercase UUID" % (where, d["shareID"]))
        k = (d.get("driver"), d.get("pool"), d.get("device"), d.get("shareID"))
        if k not in allocated:
            errors.append("%s: Invalid value: %s: must be an allocated device in the claim" %
                          (where, "/".join(str(x) for x in k if x is not None)))
        if k in seen:
            errors.append("%s: Duplicate value" % where)
        seen.add(k)
        conditions = d.get("conditions") or []
        if len(conditions) > MAX_DEVICE_STATUS_CONDITIONS:
            errors.append("%s.conditions: Too many: %d: must have at most %d items" %
                          (where, len(conditions), MAX_DEVICE_STATUS_CONDITIONS))
        types = set()
        for j, c in enumerate(conditions):
            cw = "%s.conditions[%d]" % (where, j)
            if not isinstance(c, dict):
                errors.append(cw + ": must be an object")
                continue
            if not isinstance(c.get("type"), str) or _label_name(c["type"]):
                errors.append(cw + ".type: Invalid value: %r: a qualified name" % (c.get("type"),))
            if c.get("type") in types:
                errors.append(cw + ".type: Duplicate value: %r" % (c.get("type"),))
            types.add(c.get("type"))
            if c.get("status") not in ("True", "False", "Unknown"):
                errors.append(cw + ".status: Unsupported value: %r: supported values: \"False\", \"True\", "
                                   "\"Unknown\"" % (c.get("status"),))
            reason = c.get("reason")
            if not isinstance(reason, str) or not reason:
                errors.append(cw + ".reason: Required value")
            elif len(reason) > 1024 or not _CONDITION_REASON_RE.match(reason):
                errors.append(cw + ".reason: Invalid value: %r: a condition reason (CamelCase)" % reason)
            if len(c.get("message") or "") > 32768:
                errors.append(cw + ".message: Too long")
            if not isinstance(c.get("lastTransitionTime"), str) or not _RFC3339_RE.match(c["lastTransitionTime"]):
                errors.append(cw + ".lastTransitionTime: Required value: an RFC 3339 time")
            if "observedGeneration" in c and (not isinstance(c["observedGeneration"], int)
                                              or c["observedGeneration"] < 0):
                errors.append(cw + ".observedGeneration: must be >= 0")
        if "data" in d:
            raw = json.dumps(d["data"], separators=(",", ":"))
            if len(raw) > MAX_DEVICE_STATUS_DATA:
                errors.append("%s.data: Too long: may not be more than %d bytes" % (where, MAX_DEVICE_STATUS_DATA))
            elif not isinstance(d["data"], dict):
                errors.append("%s.data: Invalid value: \"<value omitted>\": must be a valid JSON object" % where)
    return errors


def drop_disabled_fields(obj, gates):
    """What the API server does before validating a write: fields of disabled features go."""
    if gates.get("DRADeviceTaints", True):
        return
    for device in ((obj or {}).get("spec") or {}).get("devices") or []:
        if isinstance(device, dict):
            device.pop("taints", None)


def default_taint_times(obj):
    """A taint written without timeAdded gets the time of the write."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    for device in (obj.get("spec") or {}).get("devices") or []:
        for taint in device.get("taints") or []:
            if taint.get("timeAdded") is None:
                taint["timeAdded"] = now


def canonicalize_slice(obj):
    for device in (obj.get("spec") or {}).get("devices") or []:
        for cap in (device.get("capacity") or {}).values():
            if "value" in cap:
                cap["value"] = canonical_quantity(cap["value"])
            policy = cap.get("requestPolicy")
            if not isinstance(policy, dict):
                continue
            if policy.get("default") is not None:
                policy["default"] = canonical_quantity(policy["default"])
            for key, bound in list((policy.get("validRange") or {}).items()):
                if bound is not None:
                    policy["validRange"][key] = canonical_quantity(bound)
            if policy.get("validValues"):
                policy["validValues"] = [canonical_quantity(v) for v in policy["validValues"]]


# ------------------------------------------------------------- the server

def status_body(code, reason, message, details=None):
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}
    if details:
        body["details"] = details
    return body


# ------------------------------------------- other kinds: create and apply
#
# The kinds deploy/ and deploy/examples/ hold, created (POST) or applied
# (PATCH, server-side apply), for real or as a server-side dry run
# (?dryRun=All). A dry run goes through exactly the steps of a write -
# options, decoding (fieldValidation), defaulting, the namespace on the URL,
# validation, admission, the existence check - and stops before storage, as
# the API server's does:
#   staging/src/k8s.io/apiserver/pkg/endpoints/handlers/create.go,
#     createHandler: CreateOptions decoded (an error: 400) and validated
#     (ValidateCreateOptions, ValidateDryRun in apimachinery's
#     pkg/apis/meta/v1/validation: any value but "All" is refused as 422
#     Invalid, CreateOptions.meta.k8s.io "" is invalid: dryRun: Unsupported
#     value), WipeObjectMetaSystemFields, the namespace checked;
#   staging/src/k8s.io/apiserver/pkg/registry/generic/registry/store.go,
#     Store.create: FillObjectMetaSystemFields (uid, creationTimestamp: set
#     on a dry run too), generateName, rest.BeforeCreate (PrepareForCreate,
#     Validate, ObjectMeta validation), admission;
#   staging/src/k8s.io/apiserver/pkg/registry/generic/registry/dryrun.go,
#     DryRunnableStorage.Create: with dryRun, an object that exists is
#     AlreadyExists (409), else the object is answered as it would be stored
#     but never written - no resourceVersion is given (storage sets it);
#     DryRunnableStorage.GuaranteedUpdate (what apply runs): the update is
#     computed on the stored object and answered, not written, keeping the
#     stored resourceVersion.
# An apply of an object that does not exist creates it (201), as upstream's
# patch handler allows for apply.
#
# What is modelled of each kind (the rest is stored as written):
#   all: metadata (name per kind, labels, annotations, owner references,
#     finalizers), the object's kind/apiVersion matching the URL, the 1.36
#     schema (kubernetes-validate; fieldValidation Strict: an unknown field
#     is 400 "strict decoding error", Warn (the default) and Ignore drop it,
#     Warn with a Warning header), generation 1 where the kind's strategy
#     sets it, status cleared on create;
#   Namespace: spec.finalizers [kubernetes], status.phase Active, the label
#     kubernetes.io/metadata.name;
#   namespaced kinds: the NamespaceLifecycle admission check (a namespace
#     that does not exist: 404), default, kube-system, kube-public and
#     kube-node-lease existing from the start;
#   Pod and pod templates: container names, images, restartPolicy per owner
#     kind, resourceClaims and the claims containers name, extended
#     resources (whole numbers, request = limit; a Pod's requests defaulted
#     from its limits), quantities in canonical form; a Pod's status
#     (phase Pending, qosClass);
#   Deployment, DaemonSet: selector required, matching the template's labels,
#     immutable; Job: restartPolicy OnFailure or Never;
#   DeviceClass, ResourceClaimTemplate: resource.k8s.io/v1 validation of
#     selectors, requests (exactly / firstAvailable), constraints, config and
#     extendedResourceName, and v1 defaulting (allocationMode ExactCount,
#     count 1, toleration operator Equal, quantities canonical);
#     ResourceClaimTemplate spec immutable.
# Not modelled: managedFields, field-manager conflicts (an apply over an
# existing object merges maps, replacing lists), and the many defaults of
# workload kinds beyond the above (SetDefaults_PodSpec, Job's selector...).

# (group, version, resource) -> (kind, namespaced, how its name is checked)
KINDS = {
    ("", "v1", "namespaces"): ("Namespace", False, "label"),
    ("", "v1", "configmaps"): ("ConfigMap", True, "subdomain"),
    ("", "v1", "serviceaccounts"): ("ServiceAccount", True, "subdomain"),
    ("", "v1", "pods"): ("Pod", True, "subdomain"),
    ("apps", "v1", "daemonsets"): ("DaemonSet", True, "subdomain"),
    ("apps", "v1", "deployments"): ("Deployment", True, "subdomain"),
    ("batch", "v1", "jobs"): ("Job", True, "subdomain"),
    ("rbac.authorization.k8s.io", "v1", "clusterroles"): ("ClusterRole", False, "segment"),
    ("rbac.authorization.k8s.io", "v1", "clusterrolebindings"): ("ClusterRoleBinding", False, "segment"),
    ("rbac.authorization.k8s.io", "v1", "roles"): ("Role", True, "segment"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"): ("RoleBinding", True, "segment"),
    ("admissionregistration.k8s.io", "v1", "validatingadmissionpolicies"):
        ("ValidatingAdmissionPolicy", False, "subdomain"),
    ("admissionregistration.k8s.io", "v1", "validatingadmissionpolicybindings"):
        ("ValidatingAdmissionPolicyBinding", False, "subdomain"),
    ("resource.k8s.io", "v1", "deviceclasses"): ("DeviceClass", False, "subdomain"),
    ("resource.k8s.io", "v1", "resourceclaimtemplates"): ("ResourceClaimTemplate", True, "subdomain"),
}
KINDS_RULE = {kind: rule for (kind, _, rule) in KINDS.values()}
KINDS_GROUP = {kind: group for (group, _, _), (kind, _, _) in KINDS.items()}
# Kinds whose PrepareForCreate sets metadata.generation = 1 (and whose
# PrepareForUpdate raises it when the spec changes).
GENERATION_KINDS = {"Pod", "DaemonSet", "Deployment", "Job", "ValidatingAdmissionPolicy",
                    "ValidatingAdmissionPolicyBinding", "DeviceClass"}
INITIAL_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
MAX_ANNOTATIONS_SIZE = 256 * 1024
MAX_OPAQUE_PARAMETERS = 10 * 1024
MAX_REQUESTS = 32
MAX_SUBREQUESTS = 8
MAX_SELECTORS = 32
MAX_CONFIGS = 32
MAX_CEL_LENGTH = 10 * 1024


class ApiError(Exception):
    """An answer other than success: HTTP code and Status body."""

    def __init__(self, code, body, headers=None):
        super().__init__(body.get("message"))
        self.code, self.body, self.headers = code, body, headers or {}


def invalid_error(group, kind, name, errors):
    """errors.NewInvalid: 422 with the field errors (one, or [a, b] as Go's aggregate prints them)."""
    qualified = kind + ("." + group if group else "")
    text = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
    causes = []
    for e in errors:
        where, _, what = e.partition(": ")
        causes.append({"reason": "FieldValueInvalid", "message": what, "field": where})
    details = {"name": name, "kind": kind, "causes": causes}
    if group:
        details["group"] = group
    return ApiError(422, status_body(422, "Invalid", '%s "%s" is invalid: %s' % (qualified, name, text), details))


def go_quote(value):
    return json.dumps(value) if isinstance(value, str) else str(value)


def go_map(m):
    """A map[string]string as Go's %#v prints it."""
    return "map[string]string{%s}" % ", ".join("%s:%s" % (json.dumps(k), json.dumps(v))
                                              for k, v in sorted((m or {}).items()))


def options_error(kind, query, patch=False):
    """The CreateOptions / PatchOptions check (ValidateCreateOptions,
    ValidatePatchOptions): (dry run?, ApiError or None)."""
    dry = query.get("dryRun", [])
    errors = []
    if patch and not (query.get("fieldManager") or [""])[0]:
        errors.append("fieldManager: Required value: is required for apply patch")
    manager = (query.get("fieldManager") or [""])[0]
    if len(manager) > 128:
        errors.append("fieldManager: Too long: may not be more than 128 bytes")
    if any(v != "All" for v in dry):
        errors.append('dryRun: Unsupported value: []string{%s}: supported values: "All"'
                      % ", ".join(json.dumps(v) for v in dry))
    validation = (query.get("fieldValidation") or [""])[0]
    if validation not in ("", "Ignore", "Warn", "Strict"):
        # The handler's fieldValidation(): an unknown directive is a bad request.
        return bool(dry), ApiError(400, status_body(400, "BadRequest",
                                                    "fieldValidation must be one of Ignore, Warn or Strict, "
                                                    "got " + validation))
    if errors:
        return bool(dry), invalid_error("meta.k8s.io", kind, "", errors)
    return bool(dry), None


def _canonical_quantities(mapping):
    for key, value in list((mapping or {}).items()):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        mapping[key] = canonical_quantity(value)


def _name_problem(name, rule):
    if rule == "label":
        if not (isinstance(name, str) and len(name) <= 63 and _DNS_LABEL_RE.match(name)):
            return ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and "
                    "must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used "
                    "for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')")
    elif rule == "subdomain":
        if not _dns_subdomain(name):
            return ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or "
                    "'.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used "
                    "for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
    elif name in (".", "..") or "/" in name or "%" in name:
        return "may not be '.' or '..', and may not contain '/' or '%'"
    return None


def validate_object_meta(meta, rule, errors):
    """ValidateObjectMeta (apimachinery's api/validation, ValidateObjectMetaAccessor)."""
    name = meta.get("name")
    if not name:
        errors.append("metadata.name: Required value: name or generateName is required")
    else:
        problem = _name_problem(name, rule)
        if problem:
            errors.append("metadata.name: Invalid value: %s: %s" % (json.dumps(name), problem))
    for key, value in (meta.get("labels") or {}).items():
        problem = _label_name(key)
        if problem:
            errors.append("metadata.labels: Invalid value: %s: %s" % (json.dumps(key), problem))
        if not (isinstance(value, str) and len(value) <= MAX_LABEL_VALUE_LENGTH and _LABEL_VALUE_RE.match(value)):
            errors.append("metadata.labels: Invalid value: %s: a valid label must be an empty string or consist of "
                          "alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric "
                          "character" % json.dumps(value))
    annotations = meta.get("annotations") or {}
    for key in annotations:
        problem = _label_name(key.lower())
        if problem:
            errors.append("metadata.annotations: Invalid value: %s: %s" % (json.dumps(key), problem))
    size = sum(len(k) + len(v or "") for k, v in annotations.items())
    if size > MAX_ANNOTATIONS_SIZE:
        errors.append("metadata.annotations: Too long: may not be more than %d bytes" % MAX_ANNOTATIONS_SIZE)
    for i, finalizer in enumerate(meta.get("finalizers") or []):
        problem = _label_name(finalizer)
        if problem:
            errors.append("metadata.finalizers[%d]: Invalid value: %s: %s" % (i, json.dumps(finalizer), problem))
    validate_owner_references(meta, errors)


# ---- pods and pod templates (core/v1 validation, the parts the manifests use)

def validate_pod_spec(spec, path, errors, restart_policies=("Always", "OnFailure", "Never")):
    spec = spec or {}
    policy = spec.get("restartPolicy", "Always")
    if policy not in restart_policies:
        errors.append("%s.restartPolicy: Unsupported value: %s: supported values: %s"
                      % (path, json.dumps(policy), ", ".join(json.dumps(p) for p in restart_policies)))
    claim_names = set()
    for i, claim in enumerate(spec.get("resourceClaims") or []):
        where = "%s.resourceClaims[%d]" % (path, i)
        name = claim.get("name")
        if not (isinstance(name, str) and _DNS_LABEL_RE.match(name) and len(name) <= 63):
            errors.append("%s.name: Invalid value: %s: a lowercase RFC 1123 label" % (where, json.dumps(name)))
        elif name in claim_names:
            errors.append("%s.name: Duplicate value: %s" % (where, json.dumps(name)))
        claim_names.add(name)
        sources = [k for k in ("resourceClaimName", "resourceClaimTemplateName") if claim.get(k)]
        if len(sources) != 1:
            errors.append("%s: Invalid value: %s: must specify one of: `resourceClaimName`, "
                          "`resourceClaimTemplateName`" % (where, json.dumps(claim, sort_keys=True)))
    containers = spec.get("containers") or []
    if not containers:
        errors.append(path + ".containers: Required value")
    seen = set()
    for group in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(group) or []):
            where = "%s.%s[%d]" % (path, group, i)
            name = c.get("name")
            if not (isinstance(name, str) and _DNS_LABEL_RE.match(name) and len(name) <= 63):
                errors.append("%s.name: Invalid value: %s: a lowercase RFC 1123 label" % (where, json.dumps(name)))
            elif name in seen:
                errors.append("%s.name: Duplicate value: %s" % (where, json.dumps(name)))
            seen.add(name)
            if not c.get("image"):
                errors.append(where + ".image: Required value")
            resources = c.get("resources") or {}
            for j, claim in enumerate(resources.get("claims") or []):
                if claim.get("name") not in claim_names:
                    detail = ("must be one of the names in pod.spec.resourceClaims: " + ", ".join(sorted(claim_names))
                              if claim_names else "must be one of the names in pod.spec.resourceClaims which is empty")
                    errors.append("%s.resources.claims[%d]: Not found: %s: %s"
                                  % (where, j, json.dumps(claim.get("name")), detail))
            for kind in ("limits", "requests"):
                for key, value in (resources.get(kind) or {}).items():
                    text = str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
                    if parse_quantity(text) is None:
                        errors.append("%s.resources.%s[%s]: Invalid value: %s: quantities must match the regular "
                                      "expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
                                      % (where, kind, key, json.dumps(value)))
            try:
                fake_scheduler.container_requests(c, where)
            except fake_scheduler.Invalid as e:
                errors.append(str(e))


def default_pod_spec(spec, pod):
    """Quantities canonical; for a Pod (not a template) requests defaulted from limits (SetDefaults_Pod)."""
    for group in ("initContainers", "containers"):
        for c in (spec or {}).get(group) or []:
            resources = c.get("resources")
            if not isinstance(resources, dict):
                continue
            if pod and resources.get("limits"):
                requests = resources.setdefault("requests", {})
                for key, value in resources["limits"].items():
                    requests.setdefault(key, value)
            for kind in ("limits", "requests"):
                if isinstance(resources.get(kind), dict):
                    _canonical_quantities(resources[kind])


def pod_qos_class(spec):
    """qos.GetPodQOS for the containers' requests and limits (as defaulted)."""
    requests, limits, guaranteed = {}, {}, True
    for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        resources = c.get("resources") or {}
        for kind, into in (("requests", requests), ("limits", limits)):
            for key in ("cpu", "memory"):
                value = (resources.get(kind) or {}).get(key)
                if value is not None and (parse_quantity(str(value)) or (0,))[0] != 0:
                    into[key] = True
        c_limits = resources.get("limits") or {}
        if not all(k in c_limits for k in ("cpu", "memory")):
            guaranteed = False
        for key in ("cpu", "memory"):
            if (resources.get("requests") or {}).get(key) != c_limits.get(key):
                guaranteed = False
    if not requests and not limits:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def _selector_matches(selector, labels):
    labels = labels or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def validate_workload(kind, spec, errors):
    template = spec.get("template") or {}
    tpath = "spec.template"
    if kind in ("Deployment", "DaemonSet"):
        selector = spec.get("selector")
        if not selector or not (selector.get("matchLabels") or selector.get("matchExpressions")):
            errors.append("spec.selector: Invalid value: %s: empty selector is invalid for deployment"
                          % json.dumps(selector or {}) if kind == "Deployment" else "spec.selector: Required value")
        elif not _selector_matches(selector, (template.get("metadata") or {}).get("labels")):
            errors.append("spec.template.metadata.labels: Invalid value: %s: `selector` does not match template "
                          "`labels`" % go_map((template.get("metadata") or {}).get("labels")))
        validate_pod_spec(template.get("spec"), tpath + ".spec", errors, ("Always",))
    elif kind == "Job":
        validate_pod_spec(template.get("spec"), tpath + ".spec", errors, ("OnFailure", "Never"))


# ---- resource.k8s.io/v1 DeviceClass and ResourceClaimTemplate

def _validate_opaque(opaque, path, errors):
    if not isinstance(opaque, dict):
        errors.append(path + ": Required value")
        return
    if not _dns_subdomain(opaque.get("driver"), 63):
        errors.append("%s.driver: Invalid value: %s: a lowercase RFC 1123 subdomain of at most 63 characters"
                      % (path, json.dumps(opaque.get("driver"))))
    parameters = opaque.get("parameters")
    if parameters is None:
        errors.append(path + ".parameters: Required value")
    elif not isinstance(parameters, dict):
        errors.append(path + '.parameters: Invalid value: "<value omitted>": parameters must be a valid JSON object')
    elif len(json.dumps(parameters, separators=(",", ":"))) > MAX_OPAQUE_PARAMETERS:
        errors.append("%s.parameters: Too long: may not be more than %d bytes" % (path, MAX_OPAQUE_PARAMETERS))


def _validate_selectors(selectors, path, errors):
    if len(selectors or []) > MAX_SELECTORS:
        errors.append("%s: Too many: %d: must have at most %d items" % (path, len(selectors), MAX_SELECTORS))
    for i, s in enumerate(selectors or []):
        expression = ((s or {}).get("cel") or {}).get("expression")
        if not (s or {}).get("cel"):
            errors.append("%s[%d].cel: Required value" % (path, i))
        elif not isinstance(expression, str) or not expression.strip():
            errors.append("%s[%d].cel.expression: Required value" % (path, i))
        elif len(expression) > MAX_CEL_LENGTH:
            errors.append("%s[%d].cel.expression: Too long: may not be more than %d bytes" % (path, i, MAX_CEL_LENGTH))


def _validate_exact(req, path, errors, class_required=True):
    name = req.get("deviceClassName")
    if not name:
        if class_required:
            errors.append(path + ".deviceClassName: Required value")
    elif not _dns_subdomain(name):
        errors.append("%s.deviceClassName: Invalid value: %s: a lowercase RFC 1123 subdomain" % (path, json.dumps(name)))
    _validate_selectors(req.get("selectors"), path + ".selectors", errors)
    mode = req.get("allocationMode", "ExactCount")
    count = req.get("count", 0)
    if mode == "ExactCount":
        if not isinstance(count, int) or count <= 0:
            errors.append("%s.count: Invalid value: %s: must be greater than zero" % (path, count))
    elif mode == "All":
        if count:
            errors.append("%s.count: Invalid value: %s: must not be specified when allocationMode is 'All'"
                          % (path, count))
    else:
        errors.append('%s.allocationMode: Unsupported value: %s: supported values: "All", "ExactCount"'
                      % (path, json.dumps(mode)))
    for key, value in ((req.get("capacity") or {}).get("requests") or {}).items():
        problem = _qualified_name(key)
        if problem:
            errors.append("%s.capacity.requests[%s]: Invalid value: %s" % (path, key, problem))
        if parse_quantity(str(value)) is None:
            errors.append("%s.capacity.requests[%s]: Invalid value: %s: not a quantity" % (path, key, json.dumps(value)))


def _fully_qualified(name):
    split = _prefix_and_name(name) if isinstance(name, str) else None
    return split is not None and split[0] is not None and _qualified_name(name) is None


def validate_claim_spec(spec, path, errors):
    devices = (spec or {}).get("devices") or {}
    dpath = path + ".devices"
    requests = devices.get("requests") or []
    if len(requests) > MAX_REQUESTS:
        errors.append("%s.requests: Too many: %d: must have at most %d items" % (dpath, len(requests), MAX_REQUESTS))
    names = set()
    for i, req in enumerate(requests):
        where = "%s.requests[%d]" % (dpath, i)
        name = req.get("name")
        if not (isinstance(name, str) and _DNS_LABEL_RE.match(name) and len(name) <= 63):
            errors.append("%s.name: Invalid value: %s: a lowercase RFC 1123 label" % (where, json.dumps(name)))
        elif name in names:
            errors.append("%s.name: Duplicate value: %s" % (where, json.dumps(name)))
        names.add(name)
        exact, first = req.get("exactly"), req.get("firstAvailable")
        if (exact is None) == (not first):
            errors.append(where + ": Invalid value: exactly one of `exactly` or `firstAvailable` is required")
        elif exact is not None:
            _validate_exact(exact, where + ".exactly", errors)
        else:
            if len(first) > MAX_SUBREQUESTS:
                errors.append("%s.firstAvailable: Too many: %d: must have at most %d items"
                              % (where, len(first), MAX_SUBREQUESTS))
            subnames = set()
            for j, sub in enumerate(first):
                swhere = "%s.firstAvailable[%d]" % (where, j)
                if sub.get("name") in subnames or not _DNS_LABEL_RE.match(str(sub.get("name"))):
                    errors.append("%s.name: Invalid value: %s: a unique lowercase RFC 1123 label"
                                  % (swhere, json.dumps(sub.get("name"))))
                subnames.add(sub.get("name"))
                names.add("%s/%s" % (name, sub.get("name")))
                _validate_exact(sub, swhere, errors)
    for i, constraint in enumerate(devices.get("constraints") or []):
        where = "%s.constraints[%d]" % (dpath, i)
        for j, r in enumerate(constraint.get("requests") or []):
            if r not in names:
                errors.append("%s.requests[%d]: Invalid value: %s: must be the name of a request in the claim or "
                              "the name of a request and a subrequest separated by '/'" % (where, j, json.dumps(r)))
        attrs = [k for k in ("matchAttribute", "distinctAttribute") if constraint.get(k) is not None]
        if len(attrs) != 1:
            errors.append(where + ": Required value: exactly one constraint must be specified")
        for k in attrs:
            if not _fully_qualified(constraint[k]):
                errors.append("%s.%s: Invalid value: %s: must include a domain" % (where, k, json.dumps(constraint[k])))
    for i, config in enumerate(devices.get("config") or []):
        where = "%s.config[%d]" % (dpath, i)
        for j, r in enumerate(config.get("requests") or []):
            if r not in names and r.split("/")[0] not in names:
                errors.append("%s.requests[%d]: Invalid value: %s: must be the name of a request in the claim or "
                              "the name of a request and a subrequest separated by '/'" % (where, j, json.dumps(r)))
        _validate_opaque(config.get("opaque"), where + ".opaque", errors)


def default_claim_spec(spec):
    """resource/v1 defaulting (SetDefaults_ExactDeviceRequest, _DeviceSubRequest,
    the toleration operator) and quantities in canonical form."""
    def one(req):
        req.setdefault("allocationMode", "ExactCount")
        if req["allocationMode"] == "ExactCount" and not req.get("count"):
            req["count"] = 1
        for t in req.get("tolerations") or []:
            if not t.get("operator"):
                t["operator"] = "Equal"
        if isinstance((req.get("capacity") or {}).get("requests"), dict):
            _canonical_quantities(req["capacity"]["requests"])
    for req in ((spec or {}).get("devices") or {}).get("requests") or []:
        if isinstance(req.get("exactly"), dict):
            one(req["exactly"])
        for sub in req.get("firstAvailable") or []:
            if isinstance(sub, dict):
                one(sub)


def _extended_resource_problem(name):
    """IsExtendedResourceName, as validateDeviceClass checks extendedResourceName."""
    if "/" not in name or name.startswith("requests."):
        return "must be a fully-qualified extended resource name"
    domain = name.split("/", 1)[0]
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        return "must be a fully-qualified extended resource name outside the kubernetes.io domain"
    if _label_name("requests." + name):
        return "must be a valid qualified name once prefixed with 'requests.'"
    return None


def validate_kind(kind, obj, errors):
    spec = obj.get("spec") or {}
    if kind == "Pod":
        validate_pod_spec(spec, "spec", errors)
    elif kind in ("Deployment", "DaemonSet", "Job"):
        validate_workload(kind, spec, errors)
    elif kind == "DeviceClass":
        _validate_selectors(spec.get("selectors"), "spec.selectors", errors)
        configs = spec.get("config") or []
        if len(configs) > MAX_CONFIGS:
            errors.append("spec.config: Too many: %d: must have at most %d items" % (len(configs), MAX_CONFIGS))
        for i, config in enumerate(configs):
            _validate_opaque(config.get("opaque"), "spec.config[%d].opaque" % i, errors)
        ext = spec.get("extendedResourceName")
        if ext is not None:
            problem = _extended_resource_problem(ext)
            if problem:
                errors.append("spec.extendedResourceName: Invalid value: %s: %s" % (json.dumps(ext), problem))
    elif kind == "ResourceClaimTemplate":
        validate_claim_spec(spec.get("spec"), "spec.spec", errors)
    elif kind == "ConfigMap":
        for key in list((obj.get("data") or {})) + list((obj.get("binaryData") or {})):
            if not re.match(r"^[-._a-zA-Z0-9]+$", key) or len(key) > 253:
                errors.append("data[%s]: Invalid value: %s: a valid config key must consist of alphanumeric "
                              "characters, '-', '_' or '.'" % (key, json.dumps(key)))


def default_kind(kind, obj):
    spec = obj.get("spec")
    if kind == "Namespace":
        obj.setdefault("metadata", {}).setdefault("labels", {})["kubernetes.io/metadata.name"] = obj["metadata"]["name"]
        obj["spec"] = dict(spec or {})
        obj["spec"].setdefault("finalizers", ["kubernetes"])
        obj["status"] = {"phase": "Active"}
    elif kind == "Pod":
        default_pod_spec(spec, True)
        obj["status"] = {"phase": "Pending", "qosClass": pod_qos_class(spec or {})}
    elif kind in ("Deployment", "DaemonSet", "Job"):
        default_pod_spec(((spec or {}).get("template") or {}).get("spec"), False)
        obj.pop("status", None)
    elif kind == "ResourceClaimTemplate":
        default_claim_spec((spec or {}).get("spec"))
    elif kind in ("DeviceClass", "ValidatingAdmissionPolicy"):
        obj.pop("status", None)


def schema_checked(obj, directive):
    """The 1.36 schema as the decoder and validation apply it: (object, warnings).
    Unknown fields: Strict refuses them (400, strict decoding error), Warn
    and Ignore drop them (Warn says so). Other schema errors: 422."""
    try:
        import kubernetes_validate.utils as kv
    except ImportError:
        schema_errors(obj)  # says once that the checks are off
        return obj, []
    warnings = []
    for _ in range(100):
        try:
            kv.validate(obj, SCHEMA_VERSION, strict=True)
            return obj, warnings
        except kv.ValidationError as e:
            path = [str(p) for p in e.path]
            if e.validator == "additionalProperties":
                extra = re.findall(r"'([^']*)'", e.message.split("(", 1)[-1])
                fields = [".".join(path + [x]) for x in extra]
                if directive == "Strict":
                    raise ApiError(400, status_body(400, "BadRequest", "strict decoding error: " + ", ".join(
                        'unknown field "%s"' % f for f in fields)))
                parent = obj
                for p in e.path:
                    parent = parent[p]
                for x in extra:
                    parent.pop(x, None)
                if directive != "Ignore":
                    warnings += ['unknown field "%s"' % f for f in fields]
                continue
            raise ApiError(422, status_body(422, "Invalid", "%s: %s (schema of Kubernetes %s)" % (
                ".".join(path) or "(object)", e.message, SCHEMA_VERSION)))
        except kv.SchemaNotFoundError as e:
            raise ApiError(400, status_body(400, "BadRequest", "no schema: %s" % e))
    return obj, warnings


def merge_applied(live, applied):
    """The object after an apply over `live`: maps merged, everything else
    (lists included) as applied."""
    if not isinstance(live, dict) or not isinstance(applied, dict):
        return copy_json(applied)
    out = copy_json(live)
    for key, value in applied.items():
        out[key] = merge_applied(live.get(key), value) if isinstance(value, dict) else copy_json(value)
    return out


def copy_json(value):
    return json.loads(json.dumps(value))


def now_rfc3339():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")



class State:
    def __init__(self, args):
        self.lock = threading.RLock()  # held while answering; send_json records under it too
        self.args = args
        self.slices = {}
        self.resource_version = 1000
        # The objects of KINDS: (group, resource, namespace or "", name) -> object.
        self.objects = {}
        for name in INITIAL_NAMESPACES:
            self.objects[("", "namespaces", "", name)] = {
                "apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": name, "uid": str(uuidlib.uuid4()), "resourceVersion": self.next_version(),
                             "creationTimestamp": now_rfc3339(),
                             "labels": {"kubernetes.io/metadata.name": name}},
                "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}}
        self.failures = []  # dicts: method, regex, status, count, retry_after, message
        self.requests = []
        self.tokens = list(args.token or [])
        # Nodes created or deleted through /fake/create-node, /fake/delete-node:
        # name -> uid, None while deleted. Any other name is a Node with node_uid(name).
        self.nodes = {}
        self.gc_delay = args.gc_delay
        # POST /fake/rbac: None (everything allowed) or {"rules", "node"}.
        self.rbac = None
        # Server-side apply: field manager of each status.devices entry, by
        # claim uid, then by entry key.
        self.device_owners = {}
        self.feature_gates = {}  # name -> bool; absent: on
        for spec in args.feature_gates or []:
            for item in spec.split(","):
                name, _, value = item.partition("=")
                if name != "DRADeviceTaints" or value not in ("true", "false"):
                    sys.exit("--feature-gates %s: only DRADeviceTaints=true|false is known" % item)
                self.feature_gates[name] = value == "true"
        self.log_seq = 0
        for spec in args.fail or []:
            parts = spec.split(":")
            if len(parts) not in (4, 5):
                sys.exit("--fail %s: expected METHOD:PATH_REGEX:STATUS:COUNT[:RETRY_AFTER]" % spec)
            self.add_failure({"method": parts[0], "path": parts[1], "status": int(parts[2]),
                              "count": int(parts[3]),
                              "retry_after": parts[4] if len(parts) == 5 else None})

    def add_failure(self, failure):
        failure = dict(failure)
        failure["regex"] = re.compile(failure.get("path") or "")
        failure.setdefault("count", 1)
        failure.setdefault("method", "")
        self.failures.append(failure)

    def next_version(self):
        self.resource_version += 1
        return str(self.resource_version)

    def log_write(self, verb, name, status, body, obj, by=None):
        self.log_seq += 1
        entry = {"seq": self.log_seq, "verb": verb, "name": name, "status": status, "body": body, "object": obj}
        if by:
            entry["by"] = by
        line = json.dumps(entry, sort_keys=True)
        with open(self.args.log, "a") as f:
            f.write(line + "\n")

    # -- Authorization (RBAC as the ClusterRole's rules say, when set)
    def allowed(self, group, resource, verb, name):
        for rule in self.rbac["rules"]:
            if group not in rule.get("apiGroups", []) and "*" not in rule.get("apiGroups", []):
                continue
            if resource not in rule.get("resources", []) and "*" not in rule.get("resources", []):
                continue
            if verb not in rule.get("verbs", []) and "*" not in rule.get("verbs", []):
                continue
            names = rule.get("resourceNames")
            # resourceNames cannot restrict list, watch, create or deletecollection (RBAC).
            if names and (name is None or name not in names):
                continue
            return True
        return False

    def rbac_denies(self, method, path):
        """The reason the caller may not make this request, or None. For a
        status.devices write also the 1.36 granular check (kube-apiserver,
        pkg/registry/resource: AuthorizedForDeviceStatus): verb
        associated-node:<verb> on resourceclaims/driver named after the
        driver, when the claim is allocated on the node the caller's
        service-account token names, else arbitrary-node:<verb>."""
        with self.lock:
            if self.rbac is None:
                return None
            url = urllib.parse.urlsplit(path)
            parts = [urllib.parse.unquote(p) for p in url.path.split("/") if p]
            verb_of = {"GET": "get", "POST": "create", "PUT": "update", "DELETE": "delete", "PATCH": "patch"}
            verb = verb_of.get(method, method.lower())
            if parts[:3] == ["api", "v1", "nodes"]:
                group, resource, name = "", "nodes", parts[3] if len(parts) > 3 else None
            elif parts[:3] == ["apis", "resource.k8s.io", "v1"]:
                rest = parts[3:]
                if rest and rest[0] == "namespaces" and len(rest) >= 3:
                    rest = rest[2:]
                group, resource = "resource.k8s.io", rest[0] if rest else ""
                name = rest[1] if len(rest) > 1 else None
                if len(rest) > 2:
                    resource += "/" + rest[2]
                if name is None and verb == "get":
                    verb = "list"
            else:
                return None
            user = "system:serviceaccount:fracgpu:fracgpu-kubelet-plugin"
            if not self.allowed(group, resource, verb, name):
                return '%s "%s" is forbidden: User "%s" cannot %s resource "%s" in API group "%s"' % (
                    resource, name or "", user, verb, resource, group)
            return None

    def device_status_denied(self, verb, claim, drivers):
        """The granular check for the drivers whose entries change, or None."""
        if self.rbac is None:
            return None
        terms = ((((claim.get("status") or {}).get("allocation") or {}).get("nodeSelector") or {})
                 .get("nodeSelectorTerms") or [])
        allocated_node = None
        if len(terms) == 1 and not terms[0].get("matchExpressions") and len(terms[0].get("matchFields") or []) == 1:
            f = terms[0]["matchFields"][0]
            if f.get("key") == "metadata.name" and f.get("operator") == "In" and len(f.get("values") or []) == 1:
                allocated_node = f["values"][0]
        associated = allocated_node is not None and allocated_node == self.rbac.get("node")
        for driver in sorted(drivers):
            verbs = (["associated-node:" + verb] if associated else []) + ["arbitrary-node:" + verb]
            if not any(self.allowed("resource.k8s.io", "resourceclaims/driver", v, driver) for v in verbs):
                return ('resourceclaims.resource.k8s.io "%s" is forbidden: changing status.devices requires '
                        'resource="resourceclaims/driver", verb="%s" permission for driver %s' %
                        (claim["metadata"]["name"], verbs[0], driver))
        return None

    # -- Nodes
    def node_uid_now(self, name):
        """The uid of the Node `name` as it exists now, or None."""
        if name in self.nodes:
            return self.nodes[name]
        return node_uid(name) if _dns_subdomain(name) else None

    # -- The garbage collector
    def dangling(self, ref):
        """Whether an owner reference names an owner that is gone (isDangling):
        absent by name, or present with another uid. None: not judged (a kind
        this server does not serve)."""
        if ref.get("apiVersion") != "v1" or ref.get("kind") != "Node":
            return None
        return self.node_uid_now(ref.get("name") or "") != ref.get("uid")

    def schedule_gc(self, name, uid):
        """Look at slice `name` (the object with `uid`) after the delay, as the
        collector's queue does after an event."""
        timer = threading.Timer(self.gc_delay, self.collect, (name, uid))
        timer.daemon = True
        timer.start()

    def collect(self, name, uid):
        with self.lock:
            obj = self.slices.get(name)
            # Another object of that name by now is another item of the graph.
            if obj is None or obj["metadata"].get("uid") != uid:
                return
            refs = obj["metadata"].get("ownerReferences") or []
            verdicts = [self.dangling(r) for r in refs]
            if not any(verdicts):
                return
            if all(verdicts):
                # Background propagation: the dependent goes at once.
                self.slices.pop(name)
                self.log_write("delete", name, 200, None, obj, by="garbage-collector")
                return
            kept = [r for r, d in zip(refs, verdicts) if not d]
            obj["metadata"]["ownerReferences"] = kept
            obj["metadata"]["resourceVersion"] = self.next_version()
            self.log_write("update", name, 200, None, obj, by="garbage-collector")


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-apiserver"
    state = None  # set in main()

    def log_message(self, fmt, *args):  # quiet: tests read the log file
        pass

    # -- plumbing
    def send_json(self, code, body, headers=None):
        data = json.dumps(body).encode()
        # Recorded before the answer leaves: a client that asks for the
        # record right after its answer must find its request in it.
        with self.state.lock:
            self.state.requests.append({"method": self.command, "path": self.path, "status": code,
                                        "authorized": self.auth_result})
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def send_status(self, code, reason, message, headers=None):
        self.send_json(code, status_body(code, reason, message), headers)

    def read_body(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not raw:
            return None, None
        try:
            return json.loads(raw), None
        except ValueError as e:
            content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
            if content_type == "application/apply-patch+yaml":  # YAML, where PyYAML is at hand
                try:
                    import yaml
                    return yaml.safe_load(raw), None
                except ImportError:
                    pass
                except yaml.YAMLError as ye:
                    return None, str(ye)
            return None, str(e)

    def authorized(self):
        st = self.state
        args = st.args
        if not (st.tokens or args.token_file or args.client_ca):
            return True
        header = self.headers.get("Authorization") or ""
        if header.startswith("Bearer "):
            token = header[len("Bearer "):]
            accepted = list(st.tokens)
            if args.token_file:
                try:
                    with open(args.token_file) as f:
                        accepted.append(f.read().strip())
                except OSError:
                    pass
            if token and token in accepted:
                return True
        if args.client_ca and isinstance(self.connection, ssl.SSLSocket):
            try:
                if self.connection.getpeercert():
                    return True
            except (ValueError, ssl.SSLError):
                pass
        return False

    def injected_failure(self, method, path):
        with self.state.lock:
            for failure in self.state.failures:
                if failure["count"] <= 0:
                    continue
                if failure["method"] and failure["method"].upper() != method:
                    continue
                if not failure["regex"].search(path):
                    continue
                failure["count"] -= 1
                return failure
        return None

    # -- dispatch
    def do_GET(self):
        self.handle_any("GET")

    def do_POST(self):
        self.handle_any("POST")

    def do_PUT(self):
        self.handle_any("PUT")

    def do_DELETE(self):
        self.handle_any("DELETE")

    def do_PATCH(self):
        self.handle_any("PATCH")

    def handle_any(self, method):
        path = self.path
        body, body_error = self.read_body()
        self.auth_result = None
        if path.startswith("/fake/"):
            self.handle_control(method, path, body)
            return
        self.auth_result = authorized = self.authorized()
        if not authorized:
            self.send_status(401, "Unauthorized", "Unauthorized")
            return
        failure = self.injected_failure(method, path)
        if failure and failure.get("delay") is not None:
            time.sleep(float(failure["delay"]))
            if failure.get("status") is None:
                failure = None
        if failure:
            headers = {}
            if failure.get("retry_after") is not None:
                headers["Retry-After"] = str(failure["retry_after"])
            reason = {409: "Conflict", 429: "TooManyRequests", 403: "Forbidden", 404: "NotFound",
                      500: "InternalError", 503: "ServiceUnavailable"}.get(failure["status"], "Unknown")
            if method in ("POST", "PUT", "DELETE") and "/resourceslices" in path:
                with self.state.lock:
                    self.state.log_write({"POST": "create", "PUT": "update", "DELETE": "delete"}[method],
                                         path.rsplit("/", 1)[-1], failure["status"], body, None)
            self.send_status(failure["status"], reason, failure.get("message") or "injected failure", headers)
            return
        if body_error:
            self.send_status(400, "BadRequest", "the body is not JSON: " + body_error)
            return
        denied = self.state.rbac_denies(method, path)
        if denied:
            self.send_status(403, "Forbidden", denied)
            return
        self.route(method, path, body)

    def handle_control(self, method, path, body):
        st = self.state
        with st.lock:
            if method == "POST" and path == "/fake/fail":
                st.add_failure(body or {})
                self.send_json(200, {"ok": True})
            elif method == "POST" and path == "/fake/reset":
                st.failures = []
                st.requests = []
                self.send_json(200, {"ok": True})
            elif method == "POST" and path == "/fake/tokens":
                st.tokens = list((body or {}).get("tokens") or [])
                self.send_json(200, {"ok": True})
            elif method == "GET" and path == "/fake/requests":
                self.send_json(200, list(st.requests))
            elif method == "GET" and path == "/fake/slices":
                self.send_json(200, list(st.slices.values()))
            elif method == "POST" and path == "/fake/feature-gates":
                for name, value in (body or {}).items():
                    if name != "DRADeviceTaints" or not isinstance(value, bool):
                        self.send_status(400, "BadRequest", "only DRADeviceTaints: true|false is known")
                        return
                    st.feature_gates[name] = value
                self.send_json(200, {"ok": True, "feature_gates": st.feature_gates})
            elif method == "POST" and path == "/fake/delete-node":
                # The Node goes; the garbage collector then looks at what it
                # owns (ownerReferences naming its uid).
                name = (body or {}).get("name", "")
                uid = st.node_uid_now(name)
                if uid is None:
                    self.send_status(404, "NotFound", 'nodes "%s" not found' % name)
                    return
                st.nodes[name] = None
                owned = [(n, obj["metadata"]["uid"]) for n, obj in st.slices.items()
                         if any(r.get("uid") == uid for r in obj["metadata"].get("ownerReferences") or [])]
                for n, slice_uid in owned:
                    st.schedule_gc(n, slice_uid)
                self.send_json(200, {"ok": True, "uid": uid, "dependents": [n for n, _ in owned]})
            elif method == "POST" and path == "/fake/create-node":
                name = (body or {}).get("name", "")
                if not _dns_subdomain(name):
                    self.send_status(422, "Invalid", 'Node "%s" is invalid: metadata.name' % name)
                elif st.node_uid_now(name) is not None:
                    self.send_status(409, "AlreadyExists", 'nodes "%s" already exists' % name)
                else:
                    st.nodes[name] = str(uuidlib.uuid4())
                    self.send_json(201, {"ok": True, "uid": st.nodes[name]})
            elif method == "POST" and path == "/fake/rbac":
                body = body or {}
                rules = body.get("rules")
                if rules is not None and not isinstance(rules, list):
                    self.send_status(400, "BadRequest", "rules: a list of ClusterRole rules, or null")
                    return
                st.rbac = None if rules is None else {"rules": rules, "node": body.get("node")}
                self.send_json(200, {"ok": True})
            elif method == "POST" and path == "/fake/schedule":
                self.schedule_pod(body or {})
            elif method == "POST" and path == "/fake/forget-claim":
                self.forget_claim(body or {})
            elif method == "POST" and path == "/fake/gc":
                delay = (body or {}).get("delay")
                if not isinstance(delay, (int, float)) or isinstance(delay, bool) or delay < 0:
                    self.send_status(400, "BadRequest", "delay: seconds, a number >= 0")
                    return
                st.gc_delay = float(delay)
                self.send_json(200, {"ok": True, "delay": st.gc_delay})
            else:
                self.send_status(404, "NotFound", "no such control path")

    def forget_claim(self, body):
        """Deletes a --fixtures claim as the status writes see it: under
        their lock."""
        st = self.state
        safe = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
        namespace, name = body.get("namespace"), body.get("name")
        if not st.args.fixtures or not isinstance(namespace, str) or not isinstance(name, str) \
                or not safe.match(namespace) or not safe.match(name):
            self.send_status(400, "BadRequest", "needs --fixtures and {namespace, name}")
            return
        with st.lock:
            try:
                os.remove(os.path.join(st.args.fixtures, namespace, name + ".json"))
            except FileNotFoundError:
                pass
        self.send_json(200, {"ok": True})

    def schedule_pod(self, body):
        """The kube-scheduler's claim for a pod's extended resources
        (fake_scheduler.py), stored as a fixture claim the API serves."""
        st = self.state
        fixtures = st.args.fixtures
        pod, node, classes = body.get("pod"), body.get("node"), body.get("deviceClasses")
        if not fixtures or not isinstance(pod, dict) or not isinstance(node, str) or not isinstance(classes, list):
            self.send_status(400, "BadRequest", "needs --fixtures and {pod, node, deviceClasses}")
            return
        pod = json.loads(json.dumps(pod))
        meta = pod.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        meta.setdefault("uid", str(uuidlib.uuid4()))
        claims = []
        for root, _, files in os.walk(fixtures):
            for f in files:
                if not f.endswith(".json"):
                    continue  # a status write's file on its way in
                try:
                    with open(os.path.join(root, f)) as fh:
                        claims.append(json.load(fh))
                except (OSError, ValueError):
                    pass
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        templates = body.get("claimTemplates") or []
        try:
            made, status = fake_scheduler.schedule(pod, classes, list(st.slices.values()), node, claims, now,
                                                   templates)
        except fake_scheduler.Invalid as e:
            self.send_status(422, "Invalid", 'Pod "%s" is invalid: %s' % (meta.get("name"), e))
            return
        except (fake_scheduler.Unschedulable, ValueError) as e:
            self.send_status(409, "Unschedulable", str(e))
            return
        for claim in made:
            claim["metadata"]["resourceVersion"] = st.next_version()
            directory = os.path.join(fixtures, claim["metadata"]["namespace"])
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, claim["metadata"]["name"] + ".json")
            with open(path + ".tmp", "w") as f:
                json.dump(claim, f)
            os.replace(path + ".tmp", path)
        pod.setdefault("spec", {})["nodeName"] = node
        pod.setdefault("status", {}).update(status)
        self.send_json(200, {"claims": made, "pod": pod})

    def route(self, method, path, body):
        url = urllib.parse.urlsplit(path)
        parts = [p for p in url.path.split("/") if p]
        if self.route_kinds(method, parts, urllib.parse.parse_qs(url.query), body):
            return
        if parts[:3] == ["api", "v1", "nodes"] and len(parts) == 4 and method == "GET":
            self.get_node(urllib.parse.unquote(parts[3]))
            return
        query = urllib.parse.parse_qs(url.query)
        prefix = [p for p in API_PREFIX.split("/") if p]
        if parts[:len(prefix)] != prefix:
            self.send_status(404, "NotFound", "the server could not find the requested resource")
            return
        rest = parts[len(prefix):]
        if len(rest) == 4 and rest[0] == "namespaces" and rest[2] == "resourceclaims" and method == "GET":
            self.get_claim(rest[1], rest[3])
        elif (len(rest) == 5 and rest[0] == "namespaces" and rest[2] == "resourceclaims" and rest[4] == "status"
              and method == "PATCH"):
            self.apply_claim_status(rest[1], rest[3], query, body)
        elif rest == ["resourceslices"] and method == "GET":
            self.list_slices(query)
        elif rest == ["resourceslices"] and method == "POST":
            self.create_slice(body, query)
        elif len(rest) == 2 and rest[0] == "resourceslices" and method == "GET":
            self.get_slice(rest[1])
        elif len(rest) == 2 and rest[0] == "resourceslices" and method == "PUT":
            self.update_slice(rest[1], body, query)
        elif len(rest) == 2 and rest[0] == "resourceslices" and method == "DELETE":
            self.delete_slice(rest[1], query)
        else:
            self.send_status(404, "NotFound", "the server could not find the requested resource")

    # -- Nodes: every node exists (with a stable uid) until deleted; created again, with a new uid.
    def get_node(self, name):
        with self.state.lock:
            uid = self.state.node_uid_now(name)
        if uid is None:
            self.send_status(404, "NotFound", 'nodes "%s" not found' % name)
            return
        self.send_json(200, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "uid": uid}})

    # -- ResourceClaims
    def get_claim(self, namespace, name):
        fixtures = self.state.args.fixtures
        safe = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
        if fixtures and safe.match(namespace) and safe.match(name):
            try:
                with open(os.path.join(fixtures, namespace, name + ".json")) as f:
                    self.send_json(200, json.load(f))
                    return
            except (OSError, ValueError):
                pass
        self.send_status(404, "NotFound", 'resourceclaims.resource.k8s.io "%s" not found' % name)

    def apply_claim_status(self, namespace, name, query, body):
        """Server-side apply of a claim's status (PATCH .../status with
        Content-Type application/apply-patch+yaml): the field manager's
        status.devices entries (a list map keyed by driver, device, pool,
        shareID) replace those it applied before; others' entries stay. The
        claim is then checked as the 1.36 API server checks it and stored in
        its fixture file."""
        st = self.state
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        if content_type != "application/apply-patch+yaml":
            self.send_status(415, "UnsupportedMediaType",
                             "the body of the request was in an unknown format - accepted media types include: "
                             "application/json-patch+json, application/merge-patch+json, "
                             "application/apply-patch+yaml (this stand-in takes only the last)")
            return
        manager = (query.get("fieldManager") or [""])[0]
        if not manager:
            self.send_status(422, "Invalid", "PatchOptions.meta.k8s.io is invalid: fieldManager: Required value: "
                                             "is required for apply patch")
            return
        dry, answered = self.dry_run_of("PatchOptions", query)
        if answered:
            return
        force = (query.get("force") or ["false"])[0] == "true"
        fixtures = st.args.fixtures
        safe = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
        path = os.path.join(fixtures or "", namespace, name + ".json")
        with st.lock:
            try:
                if not fixtures or not safe.match(namespace) or not safe.match(name):
                    raise OSError()
                read_stat = os.stat(path)
                with open(path) as f:
                    claim = json.load(f)
            except (OSError, ValueError):
                self.send_status(404, "NotFound", 'resourceclaims.resource.k8s.io "%s" not found' % name)
                return
            errors = []
            if not isinstance(body, dict):
                errors.append("(object): must be an object")
                body = {}
            _unknown(body, {"apiVersion", "kind", "metadata", "status"}, "", errors)
            if body.get("apiVersion") != "resource.k8s.io/v1" or body.get("kind") != "ResourceClaim":
                errors.append("apiVersion/kind: must be resource.k8s.io/v1 ResourceClaim")
            meta = body.get("metadata") or {}
            _unknown(meta, {"name", "namespace", "uid"}, "metadata", errors)
            if meta.get("name") not in (None, name) or meta.get("namespace") not in (None, namespace):
                errors.append("metadata.name/namespace: must be the claim's")
            status = body.get("status") or {}
            _unknown(status, {"devices"}, "status", errors)
            if errors:
                self.send_status(422, "Invalid", 'ResourceClaim.resource.k8s.io "%s" is invalid: %s' %
                                 (name, "; ".join(errors)))
                return
            uid = claim["metadata"].get("uid")
            if meta.get("uid") and meta["uid"] != uid:
                self.send_status(409, "Conflict", "Operation cannot be fulfilled on resourceclaims.resource.k8s.io "
                                                  '"%s": Precondition failed: UID in precondition: %s, UID in object '
                                                  "meta: %s" % (name, meta["uid"], uid))
                return

            def key(d):
                return (d.get("driver"), d.get("device"), d.get("pool"), d.get("shareID"))

            owners = st.device_owners.setdefault(uid, {})
            old_devices = (claim.get("status") or {}).get("devices") or []
            applied = status.get("devices") or []
            applied_keys = {key(d) for d in applied if isinstance(d, dict)}
            conflicts = [k for k in applied_keys if owners.get(k) not in (None, manager)]
            if conflicts and not force:
                self.send_status(409, "Conflict", "Apply failed with %d conflict(s): status.devices owned by %s" %
                                 (len(conflicts), sorted({owners[k] for k in conflicts})))
                return
            kept = [d for d in old_devices
                    if owners.get(key(d)) != manager and key(d) not in applied_keys]
            devices = kept + [d for d in applied if isinstance(d, dict)]
            new_status = dict(claim.get("status") or {})
            if devices:
                new_status["devices"] = devices
            else:
                new_status.pop("devices", None)
            errors = validate_device_statuses(devices, new_status.get("allocation"))
            check = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                     "metadata": {"name": name, "namespace": namespace, "uid": uid},
                     "spec": claim.get("spec") or {"devices": {}}, "status": new_status}
            errors += schema_errors(check)
            if errors:
                self.send_json(422, status_body(422, "Invalid", 'ResourceClaim.resource.k8s.io "%s" is invalid: %s' %
                                                (name, "; ".join(errors)),
                                                {"name": name, "kind": "ResourceClaim",
                                                 "causes": [{"message": e} for e in errors]}))
                return
            # The drivers whose entries are added, changed or removed (getModifiedDrivers).
            old_by_key = {key(d): d for d in old_devices}
            new_by_key = {key(d): d for d in devices}
            changed = ({k[0] for k, d in new_by_key.items() if old_by_key.get(k) != d}
                       | {k[0] for k in old_by_key if k not in new_by_key})
            denied = st.device_status_denied("patch", claim, changed)
            if denied:
                self.send_status(403, "Forbidden", denied)
                return
            if dry:  # the claim as it would be stored; not written, field owners unchanged
                claim["status"] = new_status
                self.send_json(200, claim)
                return
            for k in list(owners):
                if owners[k] == manager and k not in applied_keys:
                    del owners[k]
            for k in applied_keys:
                owners[k] = manager
            # The claim as read is the one written over: one deleted or
            # rewritten by the test meanwhile is not brought back.
            try:
                now_stat = os.stat(path)
            except OSError:
                self.send_status(404, "NotFound", 'resourceclaims.resource.k8s.io "%s" not found' % name)
                return
            if (now_stat.st_ino, now_stat.st_mtime_ns) != (read_stat.st_ino, read_stat.st_mtime_ns):
                self.send_status(409, "Conflict", 'Operation cannot be fulfilled on resourceclaims.resource.k8s.io '
                                                  '"%s": the object has been modified; please apply your changes '
                                                  'to the latest version and try again' % name)
                return
            claim["status"] = new_status
            claim["metadata"]["resourceVersion"] = st.next_version()
            with open(path + ".tmp", "w") as f:
                json.dump(claim, f)
            os.replace(path + ".tmp", path)
            self.send_json(200, claim)

    # -- The other kinds (KINDS): create, apply, get, delete; dry run or not
    def route_kinds(self, method, parts, query, body):
        """Answers a request for one of KINDS, or discovery of their group
        versions; False when the path is none of them."""
        if parts[:1] == ["api"] and len(parts) >= 2:
            group, version, rest = "", parts[1], parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 3:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return False
        if not rest and method == "GET":
            served = [(g, v, r) for (g, v, r) in KINDS if (g, v) == (group, version)]
            if not served:
                return False
            resources = [{"name": r, "namespaced": KINDS[(g, v, r)][1], "kind": KINDS[(g, v, r)][0],
                          "verbs": ["create", "delete", "get", "patch"]} for g, v, r in served]
            if (group, version) == ("resource.k8s.io", "v1"):
                resources += [{"name": "resourceslices", "namespaced": False, "kind": "ResourceSlice",
                               "verbs": ["create", "delete", "get", "list", "update"]},
                              {"name": "resourceclaims", "namespaced": True, "kind": "ResourceClaim",
                               "verbs": ["get"]}]
            self.send_json(200, {"kind": "APIResourceList", "apiVersion": "v1",
                                 "groupVersion": "%s/%s" % (group, version) if group else version,
                                 "resources": resources})
            return True
        namespace = ""
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        gvr = (group, version, rest[0] if rest else "")
        if gvr not in KINDS or len(rest) > 2 or (namespace and not KINDS[gvr][1]):
            return False
        name = urllib.parse.unquote(rest[1]) if len(rest) == 2 else None
        if KINDS[gvr][1] and not namespace:
            return False  # a namespaced kind across namespaces: not served here
        try:
            if method == "POST" and name is None:
                code, obj, headers = self.write_object(gvr, namespace, None, query, body, apply=False)
            elif method == "PATCH" and name is not None:
                code, obj, headers = self.write_object(gvr, namespace, name, query, body, apply=True)
            elif method == "GET" and name is not None:
                code, obj, headers = 200, self.read_object(gvr, namespace, name), None
            elif method == "DELETE" and name is not None:
                code, obj, headers = self.delete_object(gvr, namespace, name, query)
            else:
                raise ApiError(405, status_body(405, "MethodNotAllowed",
                                                "the server does not allow this method on the requested resource"))
        except ApiError as e:
            self.send_json(e.code, e.body, e.headers)
            return True
        self.send_json(code, obj, headers)
        return True

    @staticmethod
    def qualified_resource(gvr):
        return gvr[2] + ("." + gvr[0] if gvr[0] else "")

    def not_found(self, gvr, name):
        return ApiError(404, status_body(404, "NotFound", '%s "%s" not found' % (self.qualified_resource(gvr), name),
                                         {"name": name, "group": gvr[0], "kind": gvr[2]}))

    def read_object(self, gvr, namespace, name):
        with self.state.lock:
            obj = self.state.objects.get((gvr[0], gvr[2], namespace, name))
            if obj is None:
                raise self.not_found(gvr, name)
            return copy_json(obj)

    def delete_object(self, gvr, namespace, name, query):
        dry, error = options_error("DeleteOptions", query)
        if error:
            raise error
        with self.state.lock:
            key = (gvr[0], gvr[2], namespace, name)
            obj = self.state.objects.get(key)
            if obj is None:
                raise self.not_found(gvr, name)
            if not dry:
                del self.state.objects[key]
            return 200, copy_json(obj), None

    def write_object(self, gvr, namespace, url_name, query, body, apply):
        """A create (POST) or a server-side apply (PATCH), persisted unless
        dryRun=All; (code, object as stored, headers) or ApiError."""
        group, version, resource = gvr
        kind, namespaced, rule = KINDS[gvr]
        st = self.state
        dry, error = options_error("PatchOptions" if apply else "CreateOptions", query, patch=apply)
        if error:
            raise error
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        if apply and content_type != "application/apply-patch+yaml":
            raise ApiError(415, status_body(415, "UnsupportedMediaType",
                                            "the body of the request was in an unknown format - accepted media "
                                            "types include: application/apply-patch+yaml (this stand-in takes "
                                            "only server-side apply patches)"))
        if not isinstance(body, dict):
            raise ApiError(400, status_body(400, "BadRequest", "the body is not an object"))
        api_version = "%s/%s" % (group, version) if group else version
        if body.get("apiVersion") != api_version:
            raise ApiError(400, status_body(400, "BadRequest",
                                            "the API version in the data (%s) does not match the expected API "
                                            "version (%s)" % (body.get("apiVersion"), api_version)))
        if body.get("kind") != kind:
            raise ApiError(400, status_body(400, "BadRequest", "the kind in the data (%s) is not %s, the kind of %s"
                                            % (body.get("kind"), kind, resource)))
        directive = "Strict" if apply else ((query.get("fieldValidation") or ["Warn"])[0] or "Warn")
        try:
            obj, warnings = schema_checked(copy_json(body), directive)
        except ApiError as e:
            if apply and e.code == 400:  # server-side apply refuses fields not in the schema
                e.body["message"] = e.body["message"].replace("strict decoding error: ", "failed to create typed "
                                                              "patch object: ")
            raise
        headers = {"Warning": ", ".join('299 - "%s"' % w.replace('"', '\\"') for w in warnings)} if warnings else None
        meta = obj.setdefault("metadata", {})
        if apply and meta.get("name") != url_name:
            raise ApiError(400, status_body(400, "BadRequest", "the name of the object (%s) does not match the name "
                                            "on the URL (%s)" % (meta.get("name"), url_name)))
        # WipeObjectMetaSystemFields, then the namespace of the request.
        for field in ("creationTimestamp", "uid", "deletionTimestamp", "deletionGracePeriodSeconds", "selfLink"):
            meta.pop(field, None)
        if namespaced:
            if meta.get("namespace") not in (None, "", namespace):
                raise ApiError(400, status_body(400, "BadRequest", "the namespace of the provided object does not "
                                                "match the namespace sent on the request"))
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        with st.lock:
            # NamespaceLifecycle admission, before the object is validated.
            if namespaced and ("", "namespaces", "", namespace) not in st.objects:
                raise ApiError(404, status_body(404, "NotFound", 'namespaces "%s" not found' % namespace,
                                                {"name": namespace, "kind": "namespaces"}))
            key = (group, resource, namespace, meta.get("name") or "")
            live = st.objects.get(key) if apply else None
            if live is None:
                code, stored = 201, self.prepare_create(kind, obj, dry)
                key = (group, resource, namespace, stored["metadata"]["name"])
                if key in st.objects:
                    # DryRunnableStorage.Create / etcd: the key exists.
                    raise ApiError(409, status_body(409, "AlreadyExists", '%s "%s" already exists' % (
                        self.qualified_resource(gvr), key[3]), {"name": key[3], "group": group, "kind": resource}))
            else:
                code, stored = 200, self.prepare_apply(kind, gvr, live, obj)
            if not dry:
                stored["metadata"]["resourceVersion"] = st.next_version()
                st.objects[key] = stored
            return code, copy_json(stored), headers

    def prepare_create(self, kind, obj, dry):
        meta = obj["metadata"]
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(
                random.choice("bcdfghjklmnpqrstvwxz2456789") for _ in range(5))
        meta["uid"] = str(uuidlib.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        if kind in GENERATION_KINDS:
            meta["generation"] = 1
        else:
            meta.pop("generation", None)
        default_kind(kind, obj)
        errors = []
        validate_object_meta(meta, KINDS_RULE[kind], errors)
        validate_kind(kind, obj, errors)
        group = KINDS_GROUP[kind]
        if errors:
            raise invalid_error(group, kind, meta.get("name") or "", errors)
        if meta.get("resourceVersion") and not dry:
            # etcd3 store Create: refused, as an internal error.
            raise ApiError(500, status_body(500, "InternalError", "Internal error occurred: resourceVersion should "
                                            "not be set on objects to be created"))
        return obj

    def prepare_apply(self, kind, gvr, live, applied):
        meta = applied["metadata"]
        if meta.get("resourceVersion") and meta["resourceVersion"] != live["metadata"].get("resourceVersion"):
            raise ApiError(409, status_body(409, "Conflict", 'Operation cannot be fulfilled on %s "%s": the object '
                                            "has been modified; please apply your changes to the latest version and "
                                            "try again" % (self.qualified_resource(gvr), meta["name"])))
        merged = merge_applied(live, applied)
        for field in ("uid", "creationTimestamp", "resourceVersion", "generation"):
            if field in live["metadata"]:
                merged["metadata"][field] = live["metadata"][field]
        default_kind(kind, merged)
        if "status" in live:
            merged["status"] = copy_json(live["status"])
        if kind in GENERATION_KINDS and merged.get("spec") != live.get("spec"):
            merged["metadata"]["generation"] = live["metadata"].get("generation", 0) + 1
        errors = []
        validate_object_meta(merged["metadata"], KINDS_RULE[kind], errors)
        validate_kind(kind, merged, errors)
        if kind == "ResourceClaimTemplate" and merged.get("spec") != live.get("spec"):
            errors.append("spec: Invalid value: field is immutable")
        if kind in ("Deployment", "DaemonSet") and \
                (merged.get("spec") or {}).get("selector") != (live.get("spec") or {}).get("selector"):
            errors.append("spec.selector: Invalid value: %s: field is immutable"
                          % json.dumps((merged.get("spec") or {}).get("selector"), sort_keys=True))
        if errors:
            raise invalid_error(KINDS_GROUP[kind], kind, merged["metadata"]["name"], errors)
        return merged

    # -- ResourceSlices
    @staticmethod
    def field_value(obj, key):
        value = obj
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        return value

    def list_slices(self, query):
        wanted = []
        for selector in query.get("fieldSelector", []):
            for term in selector.split(","):
                key, _, value = term.replace("==", "=").partition("=")
                if key not in ("spec.nodeName", "spec.driver", "spec.pool.name", "metadata.name"):
                    self.send_status(400, "BadRequest", 'field label not supported: "%s"' % key)
                    return
                wanted.append((key, value))
        labels = []
        for selector in query.get("labelSelector", []):
            for term in selector.split(","):
                key, _, value = term.replace("==", "=").partition("=")
                labels.append((key, value))
        with self.state.lock:
            items = [s for s in self.state.slices.values()
                     if all(self.field_value(s, k) == v for k, v in wanted)
                     and all(((s["metadata"].get("labels") or {}).get(k)) == v for k, v in labels)]
            version = str(self.state.resource_version)
        self.send_json(200, {"kind": "ResourceSliceList", "apiVersion": "resource.k8s.io/v1",
                             "metadata": {"resourceVersion": version}, "items": items})

    def get_slice(self, name):
        with self.state.lock:
            obj = self.state.slices.get(name)
        if obj is None:
            self.send_status(404, "NotFound", 'resourceslices.resource.k8s.io "%s" not found' % name)
        else:
            self.send_json(200, obj)

    def invalid(self, name, errors, verb, body, log=True):
        message = 'ResourceSlice.resource.k8s.io "%s" is invalid: %s' % (name, "; ".join(errors))
        self.send_json(422, status_body(422, "Invalid", message,
                                        {"name": name, "kind": "ResourceSlice",
                                         "causes": [{"message": e} for e in errors]}))
        if log:
            self.state.log_write(verb, name, 422, body, None)

    def dry_run_of(self, options_kind, query):
        """(dry run?, answered): a dryRun value other than All is refused (options_error)."""
        dry, error = options_error(options_kind, query)
        if error:
            self.send_json(error.code, error.body)
            return dry, True
        return dry, False

    def create_slice(self, body, query=None):
        name = ((body or {}).get("metadata") or {}).get("name")
        dry, answered = self.dry_run_of("CreateOptions", query or {})
        if answered:
            return
        with self.state.lock:
            stored = json.loads(json.dumps(body))
            drop_disabled_fields(stored, self.state.feature_gates)
            errors = validate_resource_slice(stored)
            if (body or {}).get("metadata", {}).get("resourceVersion"):
                errors.append("metadata.resourceVersion: must be empty on create")
            if errors:
                self.invalid(name, errors, "create", body, log=not dry)
                return
            if name in self.state.slices:
                self.send_status(409, "AlreadyExists", 'resourceslices.resource.k8s.io "%s" already exists' % name)
                if not dry:
                    self.state.log_write("create", name, 409, body, None)
                return
            obj = stored
            default_taint_times(obj)
            if not self.state.args.no_canonical:
                canonicalize_slice(obj)
            meta = obj["metadata"]
            meta["uid"] = str(uuidlib.uuid4())
            meta["generation"] = 1
            meta["creationTimestamp"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            if dry:  # answered as it would be stored; not stored, not in the write log
                self.send_json(201, obj)
                return
            meta["resourceVersion"] = self.state.next_version()
            self.state.slices[name] = obj
            self.state.log_write("create", name, 201, body, obj)
            if meta.get("ownerReferences"):
                self.state.schedule_gc(name, meta["uid"])
            self.send_json(201, obj)

    def update_slice(self, name, body, query=None):
        dry, answered = self.dry_run_of("UpdateOptions", query or {})
        if answered:
            return
        with self.state.lock:
            current = self.state.slices.get(name)
            if current is None:
                self.send_status(404, "NotFound", 'resourceslices.resource.k8s.io "%s" not found' % name)
                if not dry:
                    self.state.log_write("update", name, 404, body, None)
                return
            meta = (body or {}).get("metadata") or {}
            if meta.get("name") != name:
                self.send_status(400, "BadRequest", "the name of the object does not match the name on the URL")
                return
            stored = json.loads(json.dumps(body))
            drop_disabled_fields(stored, self.state.feature_gates)
            errors = validate_resource_slice(stored)
            for key in ("driver", "nodeName"):
                if (body.get("spec") or {}).get(key) != current["spec"].get(key):
                    errors.append("spec.%s: field is immutable" % key)
            if ((body.get("spec") or {}).get("pool") or {}).get("name") != current["spec"]["pool"]["name"]:
                errors.append("spec.pool.name: field is immutable")
            if errors:
                self.invalid(name, errors, "update", body, log=not dry)
                return
            if meta.get("resourceVersion") != current["metadata"]["resourceVersion"]:
                message = ('Operation cannot be fulfilled on resourceslices.resource.k8s.io "%s": the object has '
                           "been modified; please apply your changes to the latest version and try again" % name)
                self.send_status(409, "Conflict", message)
                if not dry:
                    self.state.log_write("update", name, 409, body, None)
                return
            obj = stored
            default_taint_times(obj)
            if not self.state.args.no_canonical:
                canonicalize_slice(obj)
            for key in ("uid", "creationTimestamp"):
                obj["metadata"][key] = current["metadata"][key]
            spec_changed = obj["spec"] != current["spec"]
            obj["metadata"]["generation"] = current["metadata"]["generation"] + (1 if spec_changed else 0)
            if dry:  # the stored resourceVersion kept (DryRunnableStorage.GuaranteedUpdate)
                self.send_json(200, obj)
                return
            obj["metadata"]["resourceVersion"] = self.state.next_version()
            self.state.slices[name] = obj
            self.state.log_write("update", name, 200, body, obj)
            owners = obj["metadata"].get("ownerReferences")
            if owners and owners != current["metadata"].get("ownerReferences"):
                self.state.schedule_gc(name, obj["metadata"]["uid"])
            self.send_json(200, obj)

    def delete_slice(self, name, query=None):
        dry, answered = self.dry_run_of("DeleteOptions", query or {})
        if answered:
            return
        with self.state.lock:
            obj = self.state.slices.get(name) if dry else self.state.slices.pop(name, None)
            if obj is None:
                self.send_status(404, "NotFound", 'resourceslices.resource.k8s.io "%s" not found' % name)
                if not dry:
                    self.state.log_write("delete", name, 404, None, None)
                return
            if not dry:
                self.state.log_write("delete", name, 200, None, obj)
        self.send_json(200, obj)


# ------------------------------------------------------------------- TLS

def openssl(*args):
    subprocess.run(["openssl"] + list(args), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def make_certificates(directory):
    """A CA, a server certificate for the loopback names and a client certificate, signed by it."""
    os.makedirs(directory, exist_ok=True)
    p = lambda name: os.path.join(directory, name)
    if os.path.exists(p("server.crt")):
        return
    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *curve, "-keyout", p("ca.key"), "-out", p("ca.crt"), "-days", "2",
            "-subj", "/CN=fake-apiserver-ca",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    for name, subject, extensions in (
            ("server", "/CN=fake-apiserver",
             "subjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1\nextendedKeyUsage=serverAuth\n"),
            ("client", "/O=system:nodes/CN=system:node:fake", "extendedKeyUsage=clientAuth\n")):
        with open(p(name + ".ext"), "w") as f:
            f.write(extensions)
        openssl("req", *curve, "-keyout", p(name + ".key"), "-out", p(name + ".csr"), "-subj", subject)
        openssl("x509", "-req", "-in", p(name + ".csr"), "-CA", p("ca.crt"), "-CAkey", p("ca.key"),
                "-CAcreateserial", "-out", p(name + ".crt"), "-days", "2", "-extfile", p(name + ".ext"))


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, handler, ssl_context):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.ssl_context = ssl_context
        super().__init__(address, handler)

    def get_request(self):
        sock, addr = self.socket.accept()
        if self.ssl_context:
            # The handshake runs in the handler's thread, at its first read.
            sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def handle_error(self, request, client_address):
        pass  # a client that went away (a timeout test) is not news


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port-file")
    parser.add_argument("--log")
    parser.add_argument("--fixtures")
    parser.add_argument("--tls-dir")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--token", action="append")
    parser.add_argument("--token-file")
    parser.add_argument("--client-ca")
    parser.add_argument("--fail", action="append")
    parser.add_argument("--no-canonical", action="store_true")
    parser.add_argument("--feature-gates", action="append")
    parser.add_argument("--gc-delay", type=float, default=0.1)
    parser.add_argument("--check-slice", nargs="+", metavar="FILE")
    args = parser.parse_args()

    if args.check_slice:
        bad = False
        for path in args.check_slice:
            with open(path) as f:
                errors = validate_resource_slice(json.load(f))
            for e in errors:
                print("%s: %s" % (path, e))
            bad = bad or bool(errors)
        return 1 if bad else 0
    if not args.port_file or not args.log:
        parser.error("--port-file and --log are required")

    context = None
    if args.tls_dir:
        make_certificates(args.tls_dir)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(os.path.join(args.tls_dir, "server.crt"), os.path.join(args.tls_dir, "server.key"))
        if args.client_ca:
            context.verify_mode = ssl.CERT_OPTIONAL
            context.load_verify_locations(args.client_ca)
    Handler.state = State(args)
    open(args.log, "a").close()
    server = Server((args.host, 0), Handler, context)
    port = server.server_address[1]
    tmp = args.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write("%d\n" % port)
    os.rename(tmp, args.port_file)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
