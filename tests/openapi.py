"""OpenAI's OpenAPI document (../shared/spec/openai-openapi.yaml) as JSON Schema validators for what the server
answers: the schema fuzzing (test_schema_fuzz.py) and the Responses API tests read it through here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import referencing
import yaml
from referencing.jsonschema import DRAFT202012

__all__ = ["SPEC", "Schemas", "nullable"]

SPEC = Path(__file__).resolve().parents[2] / "shared" / "spec" / "openai-openapi.yaml"


def nullable(node: Any) -> Any:
    """OpenAPI 3.0's `nullable: true`, which this 3.1 document still uses, as JSON Schema: null is allowed too."""
    if isinstance(node, list):
        return [nullable(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: nullable(v) for k, v in node.items() if k != "nullable"}
    return {"anyOf": [out, {"type": "null"}]} if node.get("nullable") is True else out


class Schemas:
    """The document's component schemas (`extra`: more of them, by name), each body checked against one by name."""

    def __init__(self, raw: dict[str, Any] | None = None, extra: dict[str, Any] | None = None):
        raw = raw if raw is not None else yaml.load(SPEC.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        schemas = {**nullable(raw["components"]["schemas"]), **(extra or {})}
        resource = DRAFT202012.create_resource({"components": {"schemas": schemas}})
        self.registry = referencing.Registry().with_resource("urn:openai", resource)

    def validate(self, name: str, body: Any, context: str = "") -> None:
        ref = {"$ref": f"urn:openai#/components/schemas/{name}"}
        error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(ref, registry=self.registry).iter_errors(body))
        assert error is None, f"not a {name} at {error.json_path}: {error.message}\n{json.dumps(body)[:4000]}\n{context}"
