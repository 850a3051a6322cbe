#!/usr/bin/env python3
"""Checks deploy/grafana/fracgpu-dashboard.json against what fracgpud serves.

Starts a real fracgpud on the simulated driver and the stand-in NVML, in a
temporary directory: two GPUs, a latency tenant and a normal one sharing GPU 0
(so the latency tenants' wait series exist), a memory-only tenant on GPU 1,
and an uncorrected ECC error injected on GPU 1 (so a reason for an unhealthy
GPU is served). It scrapes /metrics on a free loopback port, parses the text
format, and stops the daemon with SIGTERM.

Then every PromQL expression of the dashboard (panel targets and template
variable queries) is parsed, and each must name only metrics the daemon
serves, with only labels those metrics carry: in selectors (a literal value
must be one the daemon serves), in `by`/`without`, `on`/`ignoring` and
`group_left`/`group_right` clauses, and in legends (`{{label}}`), following
which labels each subexpression keeps. `instance` and `job`, which
Prometheus attaches to every scraped series, count as present. The
dashboard's structure is checked too (a datasource variable, unique panel
ids, no undefined variable), and, where kubectl is at hand, that
deploy/grafana's kustomization ships this very file.

Finally the checks are run on broken copies of the dashboard (a metric
renamed, a label renamed in a selector, in a `by` clause, in a legend, a
label value the daemon never serves) and each must be reported, so that a
check that silently stops working fails the test.

Python 3 standard library only. Exit 0: passed; 1: a problem (printed).
"""

import argparse
import copy
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

# Labels Prometheus attaches to every series it scrapes (target labels).
TARGET_LABELS = frozenset({"instance", "job"})
# Variables Grafana defines itself.
GRAFANA_BUILTINS = frozenset({
    "__interval", "__interval_ms", "__rate_interval", "__rate_interval_ms", "__range", "__range_s", "__range_ms",
    "__from", "__to", "__dashboard", "__org", "__user", "__name", "timeFilter", "__timeFilter"})

UUID0 = "GPU-da5b0a7d-0000-4000-8000-000000000001"
UUID1 = "GPU-da5b0a7d-0000-4000-8000-000000000002"
DEVICES = f"uuid={UUID0},name=Sim A,mem=16GiB,ctx=64MiB;uuid={UUID1},name=Sim B,mem=16GiB,ctx=64MiB"


class Problems:
    def __init__(self):
        self.items = []

    def add(self, where, what):
        self.items.append(f"{where}: {what}")


# ---- The daemon ----

def config_text(run_dir):
    return f"""[daemon]
run_dir = "{run_dir}"
reap_interval_ms = 50
log_level = "info"
metrics_address = "127.0.0.1:0"
health_interval = "100ms"
audit_interval = "100ms"

[[gpu]]
index = 0
context_memory = "64MiB"

[[gpu]]
index = 1
context_memory = "64MiB"

[[tenant]]
name = "inference"
gpus = 0.25
priority = "latency"
devices = [0]

[[tenant]]
name = "training"
gpus = 0.5
limit = 1.0
devices = [0]

[[tenant]]
name = "scratch"
memory = {{ "1" = "1GiB" }}
"""


def wait_for(what, predicate, seconds, log_path):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    log = pathlib.Path(log_path).read_text(errors="replace") if os.path.exists(log_path) else ""
    raise RuntimeError(f"timed out after {seconds} s waiting for {what}; fracgpud's log:\n{log}")


def http_get(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        return response.status, response.read().decode()


def scrape_daemon(fracgpud, simcuda, simnvml, tmp):
    """Runs fracgpud in `tmp`, returns its /metrics body once every series the
    setup should produce is there, and stops it (SIGTERM, exit 0)."""
    run_dir = os.path.join(tmp, "run")
    config = os.path.join(tmp, "fracgpud.toml")
    faults = os.path.join(tmp, "nvml-faults")
    log_path = os.path.join(tmp, "fracgpud.log")
    pathlib.Path(config).write_text(config_text(run_dir))
    pathlib.Path(faults).write_text("1 ecc=1\n")
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LD_LIBRARY_PATH": f"{simnvml}:{simcuda}",
        "SIMCUDA_DEVICES": DEVICES,
        "SIMCUDA_STATE": os.path.join(tmp, "sim-state"),
        "SIMNVML_FAULTS": faults,
    }
    with open(log_path, "wb") as log:
        daemon = subprocess.Popen([fracgpud, "--config", config], stdin=subprocess.DEVNULL, stdout=log,
                                  stderr=subprocess.STDOUT, env=env)
    try:
        def port():
            m = re.search(r"metrics: serving http://127\.0\.0\.1:(\d+)/metrics",
                          pathlib.Path(log_path).read_text(errors="replace"))
            if daemon.poll() is not None:
                raise RuntimeError(f"fracgpud exited with {daemon.returncode}:\n"
                                   + pathlib.Path(log_path).read_text(errors="replace"))
            return int(m.group(1)) if m else None

        metrics_port = wait_for("the metrics endpoint", port, 20, log_path)
        expected = ("fracgpu_gpu_unhealthy_reason{", "fracgpu_gpu_time_wait_seconds{",
                    "fracgpu_audit_uncharged_processes{", "fracgpu_memory_quota_bytes{", "fracgpu_daemon_up 1\n")

        def complete_scrape():
            status, body = http_get(metrics_port, "/metrics")
            return body if status == 200 and all(e in body for e in expected) else None

        body = wait_for(f"a scrape with {', '.join(expected)}", complete_scrape, 20, log_path)
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(timeout=10)
                raise RuntimeError("fracgpud did not stop within 10 s of SIGTERM")
    if daemon.returncode != 0:
        raise RuntimeError(f"fracgpud exited with {daemon.returncode} on SIGTERM:\n"
                           + pathlib.Path(log_path).read_text(errors="replace"))
    return body


# ---- The text format ----

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL_PAIR = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(,|$)')


def parse_exposition(body):
    """name -> {"type", "labels": {label: set(values)}, "samples"}; raises on
    a line that is not in the text format."""
    metrics = {}
    for number, line in enumerate(body.split("\n"), 1):
        if not line:
            continue
        m = re.fullmatch(rf"# (HELP|TYPE) ({NAME}) (.*)", line)
        if m:
            entry = metrics.setdefault(m.group(2), {"type": None, "labels": {}, "samples": 0})
            if m.group(1) == "TYPE":
                entry["type"] = m.group(3)
            continue
        if line.startswith("#"):
            continue
        m = re.fullmatch(rf"({NAME})(?:\{{(.*)\}})? (\S+)(?: -?\d+)?", line)
        if not m:
            raise ValueError(f"line {number} is not in the text format: {line!r}")
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        float(value)  # NaN, +Inf parse too
        entry = metrics.get(name)
        if entry is None or entry["type"] is None:
            raise ValueError(f"line {number}: sample of {name} before its TYPE")
        rest = labels
        while rest:
            pair = LABEL_PAIR.match(rest)
            if not pair:
                raise ValueError(f"line {number}: bad labels {labels!r}")
            entry["labels"].setdefault(pair.group(1), set()).add(
                pair.group(2).replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\"))
            rest = rest[pair.end():]
        entry["samples"] += 1
    return metrics


# ---- PromQL: just enough to know which metrics and labels an expression uses ----

class PromQLError(Exception):
    pass


TOKEN = re.compile(r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<var>\$\{[^}]+\}|\$[A-Za-z_][A-Za-z0-9_]*)
  | (?P<duration>(?:\d+(?:ms|[smhdwy]))+)
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>==|!=|>=|<=|=~|!~|[-+*/%^<>=@:,(){}\[\]])
""", re.VERBOSE)

AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
                "quantile", "limitk", "limit_ratio"}
AGGREGATIONS_WITH_PARAM = {"count_values", "bottomk", "topk", "quantile", "limitk", "limit_ratio"}
# Functions: argument kinds ("v" instant vector, "m" range vector, "s"
# scalar, "str" string; a trailing "*" repeats the last) and the result
# ("v": the labels of the first vector argument, "s": scalar, "novec": a
# vector without labels).
FUNCTIONS = {
    **{f: (["m"], "v") for f in ("rate", "irate", "increase", "delta", "idelta", "deriv", "resets", "changes",
                                 "avg_over_time", "min_over_time", "max_over_time", "sum_over_time",
                                 "count_over_time", "last_over_time", "stddev_over_time", "stdvar_over_time",
                                 "present_over_time", "absent_over_time", "mad_over_time")},
    "quantile_over_time": (["s", "m"], "v"),
    "predict_linear": (["m", "s"], "v"),
    "holt_winters": (["m", "s", "s"], "v"),
    "double_exponential_smoothing": (["m", "s", "s"], "v"),
    **{f: (["v"], "v") for f in ("abs", "ceil", "floor", "exp", "ln", "log2", "log10", "sqrt", "sgn", "timestamp",
                                 "sort", "sort_desc", "absent", "deg", "rad")},
    "round": (["v", "s?"], "v"),
    "clamp": (["v", "s", "s"], "v"),
    "clamp_min": (["v", "s"], "v"),
    "clamp_max": (["v", "s"], "v"),
    "histogram_quantile": (["s", "v"], "v"),
    "label_replace": (["v", "str", "str", "str", "str"], "v"),
    "label_join": (["v", "str", "str", "str*"], "v"),
    "sort_by_label": (["v", "str*"], "v"),
    "sort_by_label_desc": (["v", "str*"], "v"),
    "scalar": (["v"], "s"),
    "vector": (["s"], "novec"),
    "time": ([], "s"),
    "pi": ([], "s"),
}
BINARY = [({"or"}, False), ({"and", "unless"}, False), ({"==", "!=", "<=", "<", ">=", ">"}, False),
          ({"+", "-"}, False), ({"*", "/", "%", "atan2"}, False), ({"^"}, True)]
SET_OPS = {"or", "and", "unless"}


class Value:
    """An expression's type and, for vectors, the labels its series carry."""

    def __init__(self, kind, labels=frozenset()):
        self.kind = kind  # vector, matrix, scalar, string
        self.labels = frozenset(labels)
        self.text = None  # a string literal's value
        self.selector = False  # a plain selector, which a range may follow

    def __repr__(self):
        return f"{self.kind}{sorted(self.labels)}" if self.kind in ("vector", "matrix") else self.kind


def tokenize(text):
    tokens = []
    position = 0
    while position < len(text):
        m = TOKEN.match(text, position)
        if not m:
            raise PromQLError(f"cannot read {text[position:position + 20]!r}")
        position = m.end()
        kind = m.lastgroup
        if kind != "space":
            tokens.append((kind, m.group(kind)))
    tokens.append(("eof", ""))
    return tokens


def unquote(literal):
    if literal[0] == "`":
        return literal[1:-1]
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), literal[1:-1])


class Parser:
    """A recursive-descent PromQL parser that, instead of a tree, computes
    each subexpression's Value and reports every use of a metric or label
    the scrape does not back to `problem(what)`."""

    def __init__(self, text, metrics, problem):
        self.tokens = tokenize(text)
        self.i = 0
        self.metrics = metrics
        self.problem = problem
        self.used_metrics = set()

    def peek(self, ahead=0):
        return self.tokens[min(self.i + ahead, len(self.tokens) - 1)]

    def take(self, value=None, kind=None):
        token = self.peek()
        if (value is not None and token[1] != value) or (kind is not None and token[0] != kind):
            raise PromQLError(f"expected {value or kind}, found {token[1]!r}")
        self.i += 1
        return token

    def at(self, value):
        return self.peek()[1] == value and self.peek()[0] in ("op", "ident")

    def parse(self):
        value = self.expression(0)
        if self.peek()[0] != "eof":
            raise PromQLError(f"unexpected {self.peek()[1]!r}")
        return value

    # -- operators --

    def binary_operator(self, level):
        kind, text = self.peek()
        ops, _ = BINARY[level]
        return text if kind in ("op", "ident") and text in ops else None

    def expression(self, level):
        if level == len(BINARY):
            return self.unary()
        left = self.expression(level + 1)
        while True:
            op = self.binary_operator(level)
            if op is None:
                return left
            self.take()
            modifiers = self.modifiers()
            right = self.expression(level if BINARY[level][1] else level + 1)
            left = self.combine(left, op, right, modifiers)

    def label_list(self):
        self.take("(")
        labels = []
        while not self.at(")"):
            labels.append(self.take(kind="ident")[1])
            if not self.at(")"):
                self.take(",")
        self.take(")")
        return labels

    def modifiers(self):
        out = {}
        if self.at("bool"):
            self.take()
        if self.at("on") or self.at("ignoring"):
            out["match"] = (self.take()[1], self.label_list())
        if self.at("group_left") or self.at("group_right"):
            side = self.take()[1]
            out["group"] = (side, self.label_list() if self.at("(") else [])
        return out

    def combine(self, left, op, right, modifiers):
        for side in (left, right):
            if side.kind == "matrix":
                raise PromQLError(f"a range vector cannot be an operand of {op}")
        if left.kind != "vector" and right.kind != "vector":
            if op in SET_OPS:
                raise PromQLError(f"{op} needs vectors")
            return Value("scalar")
        if left.kind != "vector" or right.kind != "vector":
            return left if left.kind == "vector" else right
        how, labels = modifiers.get("match", (None, []))
        group = modifiers.get("group")
        for label in labels:
            if how == "on" and not (label in left.labels and label in right.labels):
                self.problem(f"{op} on({label}): no such label on "
                             f"{'the left' if label not in left.labels else 'the right'} operand")
            if how == "ignoring" and label not in left.labels | right.labels:
                self.problem(f"{op} ignoring({label}): no such label on either operand")
        if group:
            side, extra = group
            other = right if side == "group_left" else left
            for label in extra:
                if label not in other.labels:
                    self.problem(f"{side}({label}): no such label on the 'one' side")
            many = left if side == "group_left" else right
            return Value("vector", many.labels | set(extra))
        if op == "or":
            return Value("vector", left.labels | right.labels)
        if op in SET_OPS or how == "on":
            return Value("vector", left.labels)
        # One-to-one matching on every label (but those ignored): the two
        # sides must carry the same ones, or nothing ever matches.
        ignored = set(labels)
        if left.labels - ignored != right.labels - ignored:
            self.problem(f"{op}: the operands' labels differ ({sorted(left.labels - ignored)} against "
                         f"{sorted(right.labels - ignored)}) and no on()/ignoring() says how to match them")
        return Value("vector", left.labels - ignored)

    # -- operands --

    def unary(self):
        if self.at("-") or self.at("+"):
            self.take()
            value = self.unary()
            if value.kind not in ("vector", "scalar"):
                raise PromQLError("unary minus on a non-number")
            return value
        return self.postfix()

    def postfix(self):
        value = self.primary()
        while True:
            if self.at("["):
                self.take()
                subquery = False
                while not self.at("]"):
                    kind, text = self.take()
                    if kind == "eof":
                        raise PromQLError("unclosed [")
                    if text == ":" or (kind == "ident" and re.fullmatch(r":(?:\d+(?:ms|[smhdwy]))+", text)):
                        subquery = True  # [range:step]; ":5m" reads as a name
                    elif kind not in ("duration", "var", "number"):
                        raise PromQLError(f"not a duration in a range: {text!r}")
                self.take("]")
                if value.kind != "vector" or (not subquery and not value.selector):
                    raise PromQLError("a range applies to a selector (or, as a subquery, to a vector)")
                value = Value("matrix", value.labels)
            elif self.at("offset"):
                self.take()
                if self.at("-"):
                    self.take()
                self.take()
            elif self.at("@"):
                self.take()
                if self.peek()[0] == "ident":
                    self.take()
                    self.take("(")
                    self.take(")")
                else:
                    self.take()
            else:
                return value

    def primary(self):
        kind, text = self.peek()
        if kind == "number" or (kind == "ident" and text.lower() in ("inf", "nan") and not self.at_call()):
            self.take()
            return Value("scalar")
        if kind == "var":
            self.take()
            return Value("scalar")  # a Grafana variable standing for a number
        if kind == "string":
            self.take()
            value = Value("string")
            value.text = unquote(text)
            return value
        if self.at("("):
            self.take()
            value = self.expression(0)
            self.take(")")
            value = Value(value.kind, value.labels) if value.kind != "string" else value
            return value
        if self.at("{"):
            return self.selector(None)
        if kind == "ident":
            if text in AGGREGATIONS and (self.peek(1)[1] in ("(", "by", "without")):
                return self.aggregation()
            if self.peek(1)[1] == "(":
                return self.call()
            return self.selector(self.take()[1])
        raise PromQLError(f"unexpected {text!r}")

    def at_call(self):
        return self.peek(1)[1] == "("

    def selector(self, name):
        matchers = []
        if self.at("{"):
            self.take()
            while not self.at("}"):
                label = self.take(kind="ident")[1]
                op = self.take(kind="op")[1]
                if op not in ("=", "!=", "=~", "!~"):
                    raise PromQLError(f"bad matcher operator {op!r}")
                matchers.append((label, op, unquote(self.take(kind="string")[1])))
                if not self.at("}"):
                    self.take(",")
            self.take("}")
        if name is None:
            names = [v for label, op, v in matchers if label == "__name__" and op == "="]
            if not names:
                raise PromQLError("a selector without a metric name")
            name = names[0]
        self.used_metrics.add(name)
        served = self.metrics.get(name)
        if served is None or served["samples"] == 0:
            self.problem(f"metric {name} is not served by fracgpud" if served is None else
                         f"metric {name} is described but has no series in the scrape, so its labels are unknown")
            value = Value("vector", TARGET_LABELS)
            value.selector = True
            return value
        labels = set(served["labels"]) | TARGET_LABELS
        for label, op, wanted in matchers:
            if label == "__name__":
                continue
            if label not in labels:
                self.problem(f"{name}{{{label}{op}...}}: {name} has no label {label} "
                             f"(it has {', '.join(sorted(labels))})")
                continue
            if label in TARGET_LABELS or "$" in wanted or op not in ("=", "=~"):
                continue
            values = served["labels"][label]
            if op == "=" and wanted not in values:
                self.problem(f"{name}{{{label}=\"{wanted}\"}}: fracgpud serves {label} = "
                             f"{', '.join(sorted(values))}, never \"{wanted}\"")
            if op == "=~" and not any(re.fullmatch(wanted, v) for v in values):
                self.problem(f"{name}{{{label}=~\"{wanted}\"}}: matches none of the served values "
                             f"{', '.join(sorted(values))}")
        value = Value("vector", labels)
        value.selector = True
        return value

    def arguments(self):
        self.take("(")
        args = []
        while not self.at(")"):
            args.append(self.expression(0))
            if not self.at(")"):
                self.take(",")
        self.take(")")
        return args

    def call(self):
        name = self.take(kind="ident")[1]
        if name not in FUNCTIONS:
            raise PromQLError(f"unknown function {name}()")
        kinds, result = FUNCTIONS[name]
        args = self.arguments()
        want = {"v": "vector", "m": "matrix", "s": "scalar", "str": "string"}
        expected = []
        for k in kinds:
            if k.endswith("*"):
                expected += [k[:-1]] * max(0, len(args) - len(expected))
            elif k.endswith("?"):
                if len(args) > len(expected):
                    expected.append(k[:-1])
            else:
                expected.append(k)
        if len(args) != len(expected):
            raise PromQLError(f"{name}() takes {len(expected)} argument(s), given {len(args)}")
        for arg, k in zip(args, expected):
            if arg.kind != want[k]:
                raise PromQLError(f"{name}(): a {want[k]} argument expected, given a {arg.kind}")
        if result == "s":
            return Value("scalar")
        if result == "novec":
            return Value("vector")
        vector = next(a for a in args if a.kind in ("vector", "matrix"))
        labels = set(vector.labels)
        if name in ("label_replace", "label_join"):
            sources = [args[3].text] if name == "label_replace" else [a.text for a in args[3:]]
            for source in sources:
                if source and source not in labels:
                    self.problem(f"{name}(): source label {source} is not on its vector")
            labels.add(args[1].text)
        if name == "histogram_quantile":
            if "le" not in labels:
                self.problem("histogram_quantile(): its vector has no le label")
            labels.discard("le")
        return Value("vector", labels)

    def grouping(self):
        how = self.take()[1]
        return how, self.label_list()

    def aggregation(self):
        op = self.take(kind="ident")[1]
        grouping = self.grouping() if self.at("by") or self.at("without") else None
        self.take("(")
        parameter = None
        if op in AGGREGATIONS_WITH_PARAM:
            parameter = self.expression(0)
            self.take(",")
        argument = self.expression(0)
        self.take(")")
        if grouping is None and (self.at("by") or self.at("without")):
            grouping = self.grouping()
        if argument.kind != "vector":
            raise PromQLError(f"{op}() aggregates an instant vector, given a {argument.kind}")
        how, labels = grouping or ("by", [])
        for label in labels:
            if label not in argument.labels:
                self.problem(f"{op} {how} ({label}): no such label on what it aggregates "
                             f"(it has {', '.join(sorted(argument.labels))})")
        if op in ("topk", "bottomk", "limitk", "limit_ratio"):
            return Value("vector", argument.labels)
        result = set(labels) if how == "by" else set(argument.labels) - set(labels)
        if op == "count_values" and parameter is not None and parameter.text:
            result.add(parameter.text)
        return Value("vector", result)


def check_expression(text, metrics, where, problems, used):
    """Parses `text`; returns its Value, or None when it does not parse."""
    parser = Parser(text, metrics, lambda what: problems.add(where, what))
    try:
        value = parser.parse()
    except PromQLError as e:
        problems.add(where, f"does not parse as PromQL ({e}): {text}")
        return None
    used |= parser.used_metrics
    return value


# ---- The dashboard ----

VARIABLE = re.compile(r"\$\{([A-Za-z0-9_]+)(?::[a-z]+)?\}|\$([A-Za-z0-9_]+)|\[\[([A-Za-z0-9_]+)\]\]")


def split_top_level(text):
    """Splits at commas outside brackets and strings."""
    parts, depth, current, quote = [], 0, "", None
    for c in text:
        if quote:
            quote = None if c == quote and not current.endswith("\\") else quote
        elif c in "\"'`":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        current += c
    parts.append(current)
    return [p.strip() for p in parts]


def walk_panels(panels):
    for panel in panels:
        yield panel
        yield from walk_panels(panel.get("panels", []))


def check_variables_defined(text, defined, where, problems):
    for m in VARIABLE.finditer(text):
        if m.group(3):
            problems.add(where, f"[[{m.group(3)}]]: deprecated variable syntax, write ${m.group(3)}")
        name = m.group(1) or m.group(2)
        if name and not name.isdigit() and name not in defined and name not in GRAFANA_BUILTINS:
            problems.add(where, f"${name} is not a variable of the dashboard")


def check_dashboard(dashboard, metrics, problems):
    """Everything about the dashboard; returns the metrics it uses."""
    used = set()
    for key in ("title", "uid", "panels", "templating", "schemaVersion"):
        if key not in dashboard:
            problems.add("dashboard", f"has no {key}")
    if not isinstance(dashboard.get("schemaVersion"), int) or dashboard.get("schemaVersion", 0) < 36:
        problems.add("dashboard", "schemaVersion below 36 (Grafana 9): panels' datasource references need 36+")
    if "__inputs" in dashboard:
        problems.add("dashboard", "has __inputs: file provisioning does not resolve them; use the datasource "
                                  "variable")
    variables = dashboard.get("templating", {}).get("list", [])
    defined = {v.get("name") for v in variables}
    datasource_vars = [v["name"] for v in variables if v.get("type") == "datasource" and v.get("query") == "prometheus"]
    if not datasource_vars:
        problems.add("templating", "no datasource variable of type prometheus")
    datasource_ref = {f"${{{name}}}" for name in datasource_vars} | {f"${name}" for name in datasource_vars}

    for v in variables:
        where = f"variable ${v.get('name')}"
        if v.get("type") != "query":
            continue
        if (v.get("datasource") or {}).get("uid") not in datasource_ref:
            problems.add(where, "does not query the datasource variable")
        query = v.get("query")
        query = query.get("query", "") if isinstance(query, dict) else query or ""
        check_variables_defined(query, defined - {v.get("name")}, where, problems)
        m = re.fullmatch(r"\s*(label_values|query_result)\((.*)\)\s*", query, re.S)
        if not m:
            problems.add(where, f"not a label_values() or query_result() query: {query}")
            continue
        if m.group(1) == "query_result":
            check_expression(m.group(2), metrics, where, problems, used)
            continue
        args = split_top_level(m.group(2))
        if len(args) != 2:
            problems.add(where, f"label_values() without a metric: {query}")
            continue
        value = check_expression(args[0], metrics, where, problems, used)
        if value is not None and args[1] not in value.labels:
            problems.add(where, f"label_values(..., {args[1]}): no such label on {args[0]} "
                                f"(it has {', '.join(sorted(value.labels))})")

    ids = {}
    for panel in walk_panels(dashboard.get("panels", [])):
        where = f"panel {panel.get('id')} \"{panel.get('title')}\""
        if panel.get("id") in ids:
            problems.add(where, f"id {panel.get('id')} is also panel \"{ids[panel.get('id')]}\"'s")
        ids[panel.get("id")] = panel.get("title")
        grid = panel.get("gridPos", {})
        if not (0 <= grid.get("x", -1) and grid.get("w", 0) > 0 and grid.get("x", 0) + grid.get("w", 0) <= 24
                and grid.get("h", 0) > 0 and grid.get("y", -1) >= 0):
            problems.add(where, f"gridPos {grid} is not within the 24 columns")
        check_variables_defined(panel.get("title", ""), defined, where, problems)
        if panel.get("repeat") and panel["repeat"] not in defined:
            problems.add(where, f"repeats over ${panel['repeat']}, which is not a variable")
        if panel.get("type") == "row":
            continue
        if (panel.get("datasource") or {}).get("uid") not in datasource_ref:
            problems.add(where, "does not use the datasource variable")
        targets = panel.get("targets", [])
        if not targets:
            problems.add(where, "has no query")
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs):
            problems.add(where, f"refIds repeat: {refs}")
        for t in targets:
            twhere = f"{where} query {t.get('refId')}"
            if (t.get("datasource") or {}).get("uid") not in datasource_ref:
                problems.add(twhere, "does not use the datasource variable")
            expr = t.get("expr", "")
            check_variables_defined(expr, defined, twhere, problems)
            before = len(problems.items)
            value = check_expression(expr, metrics, twhere, problems, used)
            legend = t.get("legendFormat", "")
            check_variables_defined(legend, defined, twhere, problems)
            if len(problems.items) > before:
                continue  # its labels are not known: no follow-on reports
            for label in re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", legend):
                if value is not None and label not in value.labels:
                    problems.add(twhere, f"legend {{{{{label}}}}}: the query's series have no label {label} "
                                         f"(they have {', '.join(sorted(value.labels)) or 'none'})")
    return used


def check_kustomization(source, dashboard_path, problems):
    """deploy/grafana/kustomization.yaml builds a ConfigMap holding the file."""
    where = "deploy/grafana/kustomization.yaml"
    if shutil.which("kubectl") is None:
        print(f"note: kubectl not found: {where} is not built")
        return
    result = subprocess.run(["kubectl", "kustomize", str(source / "deploy" / "grafana")], capture_output=True,
                            text=True, timeout=60)
    if result.returncode != 0:
        problems.add(where, f"kubectl kustomize fails: {result.stderr.strip()}")
        return
    # Not a YAML parser: kubectl prints the file as a block scalar, and
    # json.loads of the unindented block must give the dashboard back.
    m = re.search(r"^  fracgpu-dashboard\.json: \|\n((?:    .*\n|\n)+)", result.stdout, re.M)
    if not m:
        problems.add(where, "builds no ConfigMap with data key fracgpu-dashboard.json")
        return
    shipped = "".join(line[4:] + "\n" for line in m.group(1).rstrip("\n").split("\n"))
    if json.loads(shipped) != json.loads(dashboard_path.read_text()):
        problems.add(where, "its ConfigMap's fracgpu-dashboard.json differs from the file")
    if not re.search(r'^    grafana_dashboard: "1"$', result.stdout, re.M):
        problems.add(where, "its ConfigMap lacks the label grafana_dashboard: \"1\" the Grafana sidecar looks for")
    print(f"{where}: kubectl kustomize builds a ConfigMap holding the dashboard")


# ---- Broken copies: each must be reported ----

def first_target(dashboard, predicate):
    for panel in walk_panels(dashboard["panels"]):
        for t in panel.get("targets", []):
            if predicate(t):
                return t
    raise LookupError("no such target in the dashboard")


def mutations():
    """(what, change, expected): `change` breaks a copy of the dashboard in
    place, and the checks must then report `expected`."""
    def edit(what, change, expected):
        return what, change, expected

    def replace_in_expr(needle, replacement):
        def change(d):
            t = first_target(d, lambda t: needle in t.get("expr", ""))
            t["expr"] = t["expr"].replace(needle, replacement, 1)
        return change

    def set_legend(needle, legend):
        def change(d):
            first_target(d, lambda t: needle in t.get("expr", ""))["legendFormat"] = legend
        return change

    def set_variable_query(name, query):
        def change(d):
            next(v for v in d["templating"]["list"] if v["name"] == name).update(query=query, definition=query)
        return change

    yield edit("a metric renamed", replace_in_expr("fracgpu_memory_used_bytes", "fracgpu_memory_usage_bytes"),
               "metric fracgpu_memory_usage_bytes is not served")
    yield edit("a label renamed in a selector", replace_in_expr('tenant=~"$tenant"', 'tenant_name=~"$tenant"'),
               "has no label tenant_name")
    yield edit("a label renamed in a by clause", replace_in_expr("max by (instance, gpu, tenant)",
                                                                  "max by (instance, uuid, tenant)"),
               "by (uuid): no such label")
    yield edit("a window the daemon does not serve", replace_in_expr('window="10s"', 'window="5s"'),
               'never "5s"')
    yield edit("a legend naming a label aggregated away", set_legend("sum by (instance) (fracgpu_tenant_processes",
                                                                      "{{tenant}}"),
               "legend {{tenant}}")
    yield edit("a variable over a label the metric lacks",
               set_variable_query("gpu", 'label_values(fracgpu_tenant_processes{instance=~"$instance"}, gpu)'),
               "label_values(..., gpu): no such label")
    yield edit("an undefined variable", replace_in_expr('gpu=~"$gpu"', 'gpu=~"$device"'),
               "$device is not a variable")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", required=True, type=pathlib.Path, help="the source tree")
    parser.add_argument("--fracgpud", required=True, help="the built fracgpud")
    parser.add_argument("--simcuda", required=True, help="the simulated driver's directory (libcuda.so.1)")
    parser.add_argument("--simnvml", required=True, help="the stand-in NVML's directory (libnvidia-ml.so.1)")
    parser.add_argument("--dashboard", type=pathlib.Path, help="default: deploy/grafana/fracgpu-dashboard.json")
    args = parser.parse_args()
    dashboard_path = args.dashboard or args.source / "deploy" / "grafana" / "fracgpu-dashboard.json"

    try:
        dashboard = json.loads(dashboard_path.read_text())
    except (OSError, ValueError) as e:
        print(f"FAIL: {dashboard_path}: {e}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="fracgpu-dashboard-") as tmp:
        try:
            body = scrape_daemon(args.fracgpud, args.simcuda, args.simnvml, tmp)
            metrics = parse_exposition(body)
        except (RuntimeError, ValueError, OSError) as e:
            print(f"FAIL: {e}", file=sys.stderr)
            return 1
    served = {name for name, m in metrics.items() if m["samples"]}
    print(f"fracgpud served {len(served)} metric(s) with series, "
          f"{sum(m['samples'] for m in metrics.values())} series in all")

    problems = Problems()
    used = check_dashboard(dashboard, metrics, problems)
    if not args.dashboard:
        check_kustomization(args.source, dashboard_path, problems)
    for p in problems.items:
        print(f"FAIL: {p}", file=sys.stderr)
    expressions = sum(len(p.get("targets", [])) for p in walk_panels(dashboard.get("panels", [])))
    print(f"checked {expressions} panel queries and {len(dashboard.get('templating', {}).get('list', []))} "
          f"variables of {dashboard_path.name}: {len(problems.items)} problem(s)")
    unused = sorted(served - used)
    if unused:
        print(f"note: served but not on the dashboard: {', '.join(unused)}")

    missed = 0
    for what, change, expected in mutations():
        broken = copy.deepcopy(dashboard)
        try:
            change(broken)
        except (LookupError, StopIteration):
            missed += 1
            print(f"FAIL: {what}: the dashboard has nothing this broken copy changes (update mutations())",
                  file=sys.stderr)
            continue
        found = Problems()
        check_dashboard(broken, metrics, found)
        if any(expected in p for p in found.items):
            print(f"caught: {what}")
        else:
            missed += 1
            print(f"FAIL: {what}: not reported (expected \"{expected}\"); reported: {found.items}", file=sys.stderr)
    return 1 if problems.items or missed else 0


if __name__ == "__main__":
    sys.exit(main())
