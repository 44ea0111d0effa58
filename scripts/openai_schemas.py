"""Extract self-contained JSON Schemas for OpenAI response bodies from OpenAI's OpenAPI description."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SPEC = REPO / ".." / "shared" / "spec" / "openai-openapi.yaml"
OUTPUT = REPO / "tests" / "data" / "openai_schemas.json"

NAMES = [
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "ListModelsResponse",
    "Model",
    "ErrorResponse",
    "Response",
    "ResponseStreamEvent",
    "ResponseItemList",
    "TokenCountsResource",
]

REF_PREFIX = "#/components/schemas/"
# Keys that only document (or are OpenAPI-only) and do not affect validation.
DROPPED = {"description", "title", "example", "examples", "discriminator", "externalDocs", "xml"}
# Keywords whose value is one subschema, a list of subschemas, or a map of name -> subschema.
ONE = {"items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else",
       "unevaluatedItems", "unevaluatedProperties", "additionalItems"}
MANY = {"anyOf", "oneOf", "allOf", "prefixItems"}
MAP = {"properties", "patternProperties", "$defs", "dependentSchemas"}


def ref_name(ref: str) -> str:
    if not ref.startswith(REF_PREFIX):
        raise ValueError(f"unsupported $ref: {ref}")
    return ref[len(REF_PREFIX):]


def clean(schema: Any, refs: set[str]) -> Any:
    """Return a copy of `schema` fit for Draft 2020-12, recording the component names it refers to."""
    if not isinstance(schema, dict):
        return schema  # a boolean schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in DROPPED or key.startswith("x-") or key == "nullable":
            continue
        if key == "$ref":
            name = ref_name(value)
            refs.add(name)
            out[key] = f"#/$defs/{name}"
        elif key in ONE:
            out[key] = clean(value, refs)
        elif key in MANY or (key == "items" and isinstance(value, list)):
            out[key] = [clean(v, refs) for v in value]
        elif key in MAP:
            out[key] = {k: clean(v, refs) for k, v in value.items()}
        else:
            out[key] = value  # type, required, enum, const, default, format, ...: plain data
    if schema.get("nullable") is True:
        out = allow_null(out)
    return out


def allow_null(schema: dict[str, Any]) -> dict[str, Any]:
    """Turn an OpenAPI 3.0 `nullable: true` into JSON Schema's null type."""
    if "type" in schema and "$ref" not in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        schema["type"] = types if "null" in types else [*types, "null"]
        if "enum" in schema and None not in schema["enum"]:
            schema["enum"] = [*schema["enum"], None]
        return schema
    return {"anyOf": [schema, {"type": "null"}]}


def self_contained(name: str, components: dict[str, Any]) -> dict[str, Any]:
    """Component `name` with every schema it reaches, directly or not, inlined under `$defs`."""
    refs: set[str] = set()
    root = clean(components[name], refs)
    defs: dict[str, Any] = {}
    pending = sorted(refs)
    while pending:
        dep = pending.pop()
        if dep in defs:
            continue
        dep_refs: set[str] = set()
        defs[dep] = clean(components[dep], dep_refs)
        pending.extend(sorted(dep_refs - defs.keys()))
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **root}
    if defs:
        schema["$defs"] = {k: defs[k] for k in sorted(defs)}
    return schema


def nullable_count(name: str, components: dict[str, Any]) -> int:
    """How many `nullable: true` the raw closure of `name` holds (reported, and converted by `clean`)."""
    seen: set[str] = set()
    count = 0
    pending = [name]
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        text = json.dumps(components[current])
        count += text.count('"nullable": true')
        refs: set[str] = set()
        clean(components[current], refs)
        pending.extend(refs)
    return count


def main(argv: list[str]) -> None:
    spec_path = Path(argv[1]) if len(argv) > 1 else DEFAULT_SPEC.resolve()
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(spec_path, encoding="utf-8") as f:
        spec = yaml.load(f, Loader=loader)
    components = spec["components"]["schemas"]
    result = {
        "source": f"{spec_path.name}, OpenAI API {spec['info']['version']} (OpenAPI {spec['openapi']})",
        "licence": "MIT, OpenAI openai-openapi",
        "schemas": {name: self_contained(name, components) for name in NAMES},
    }
    for name in NAMES:
        defs = result["schemas"][name].get("$defs", {})
        print(f"{name}: {len(defs)} $defs, {nullable_count(name, components)} nullable: true converted")
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {OUTPUT.relative_to(REPO)} ({OUTPUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main(sys.argv)
