#!/usr/bin/env python3
"""Validates CDI spec files against the CDI JSON schema (cdi-schema/, from the
Container Device Interface project; see cdi-schema/README.md).

Usage: validate_cdi.py SPEC.json [SPEC.json ...]
Exit 0 when every file is valid; 1 with each error (file, JSON path, reason)
otherwise; 77 (skipped) without python3-jsonschema.
"""
import json
import pathlib
import sys

try:
    import jsonschema
    from jsonschema import Draft7Validator
except ImportError:
    print("SKIPPED: python3-jsonschema is not installed")
    sys.exit(77)

SCHEMA_DIR = pathlib.Path(__file__).resolve().parent / "cdi-schema"


def validator():
    schema = json.loads((SCHEMA_DIR / "schema.json").read_text())
    defs = json.loads((SCHEMA_DIR / "defs.json").read_text())
    # schema.json refers to "defs.json#/definitions/...": resolved locally.
    try:
        from referencing import Registry, Resource  # jsonschema >= 4.18
    except ImportError:
        base = SCHEMA_DIR.as_uri() + "/"
        resolver = jsonschema.RefResolver(base_uri=base + "schema.json", referrer=schema,
                                          store={base + "defs.json": defs})
        return Draft7Validator(schema, resolver=resolver)
    registry = Registry().with_resource("defs.json", Resource.from_contents(defs, default_specification=draft7_spec()))
    return Draft7Validator(schema, registry=registry)


def draft7_spec():
    from referencing.jsonschema import DRAFT7
    return DRAFT7


def main(paths):
    if not paths:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    check = validator()
    failed = False
    for path in paths:
        try:
            spec = json.loads(pathlib.Path(path).read_text())
        except (OSError, ValueError) as e:
            print(f"{path}: {e}")
            failed = True
            continue
        for error in sorted(check.iter_errors(spec), key=lambda e: list(e.absolute_path)):
            where = "/".join(str(p) for p in error.absolute_path) or "(top)"
            print(f"{path}: {where}: {error.message}")
            failed = True
    if not failed:
        print(f"valid: {len(paths)} spec(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
