"""The structured-output cases shared by tests and bench/structured.py: twenty JSON schemas of
different shapes (nested objects, arrays, enums, integers and numbers with bounds, strings with
patterns, optional and required fields, const, anyOf / null, $ref), a regex, a choice list and a
small grammar. Strings and arrays are bounded so the tiny models' answers (48 tokens, one
character a token) can close; each case's `check(text)` says whether a complete answer holds to it
(jsonschema for JSON, `re.fullmatch` for the regex and the grammar's language)."""
from __future__ import annotations

import json
import re
from typing import Any

S = {"type": "string", "maxLength": 4}
OBJ = {"type": "object", "additionalProperties": False}


def _obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {**OBJ, "properties": properties, "required": list(properties) if required is None else required, **extra}


SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": _obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "nested": _obj({"user": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 9}, "ok": {"type": "boolean"}})}),
    "deep": _obj({"a": _obj({"b": _obj({"c": {"type": "integer", "minimum": 0, "maximum": 9}})})}),
    "int_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1,
                  "maxItems": 3},
    "string_array": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    "enum": _obj({"colour": {"enum": ["red", "green", "blue"]}}),
    "enum_mixed": {"enum": [1, "two", None, True]},
    "int_bounds": _obj({"n": {"type": "integer", "minimum": -20, "maximum": -10}}),
    "number_bounds": _obj({"x": {"type": "number", "minimum": 0, "maximum": 1}}),
    "exclusive": _obj({"k": {"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 9}}),
    "pattern": _obj({"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}),
    "date_like": _obj({"d": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]$"}}),
    "optional": _obj({"a": {"type": "integer", "minimum": -5, "maximum": 5}, "b": {"type": "string", "maxLength": 3}},
                     required=["a"]),
    "all_optional": _obj({"p": {"type": "boolean"}, "q": {"type": "null"}}, required=[]),
    "array_of_objects": {"type": "array", "maxItems": 2, "items": _obj({"k": {"enum": ["x", "y"]},
                                                                         "v": {"type": "boolean"}})},
    "nullable": _obj({"score": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 10, "maximum": 20}]}}),
    "const": _obj({"kind": {"const": "pt"}, "x": {"type": "integer", "minimum": 0, "maximum": 9}}),
    "ref": {"$defs": {"pt": _obj({"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                  "y": {"type": "integer", "minimum": 0, "maximum": 9}})},
            **_obj({"p": {"$ref": "#/$defs/pt"}})},
    "tuple": {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9},
                                               {"enum": ["a", "b"]}], "items": False, "minItems": 2},
    "scalar_bool": {"type": "boolean"},
}
assert len(SCHEMAS) == 20

REGEX = r"[A-Z][a-z]{1,4}-[0-9]{2}"
CHOICE = ["yes", "no", "maybe"]
GRAMMAR = 'start: "(" NUM ("+" NUM)? ")"\nNUM: /[0-9]{1,2}/'
GRAMMAR_LANGUAGE = r"\([0-9]{1,2}(\+[0-9]{1,2})?\)"


class Case:
    """One structure: `structured` (the `structured_outputs` JSON form) and `check(text)`."""

    def __init__(self, name: str, structured: dict[str, Any]) -> None:
        self.name, self.structured = name, structured

    def check(self, text: str) -> None:
        """Raises (AssertionError / jsonschema.ValidationError / ValueError) unless `text` holds."""
        if "json" in self.structured:
            import jsonschema

            jsonschema.validate(json.loads(text), self.structured["json"])
        elif "regex" in self.structured:
            assert re.fullmatch(self.structured["regex"], text), text
        elif "choice" in self.structured:
            assert text in self.structured["choice"], text
        else:
            assert re.fullmatch(GRAMMAR_LANGUAGE, text), text

    def __repr__(self) -> str:
        return f"Case({self.name})"


CASES: list[Case] = ([Case(name, {"json": schema}) for name, schema in SCHEMAS.items()]
                     + [Case("regex", {"regex": REGEX}), Case("choice", {"choice": CHOICE}),
                        Case("grammar", {"grammar": GRAMMAR})])
