"""Plugin manifests and input validation: errors name the field and what is allowed."""
import pytest

from sdk.protocol.manifest import ManifestError, load_manifest, parse_manifest
from sdk.protocol.schema import InputError, InputSchema

BASE = {"name": "p", "version": "1.0.0", "publisher": "x", "entrypoint": "plugin:P",
        "output": "images", "work_units": "steps * 2",
        "inputs": {"steps": {"type": "integer", "default": 10, "minimum": 1, "maximum": 50},
                   "prompt": {"type": "string", "required": True, "max_length": 5},
                   "size": {"type": "integer", "default": 64, "multiple_of": 8},
                   "mode": {"type": "string", "default": "a", "choices": ["a", "b"]}},
        "benchmark": {"inputs": {"prompt": "a"}}}


def test_builtin_manifests_load():
    m = load_manifest("plugins/echo")
    assert m.name == "echo" and m.inputs.validate({}) == {"text": "", "sleep_ms": 0, "steps": 1,
                                                          "stream": False}


@pytest.mark.parametrize("inputs,field,fragment", [
    ({}, "prompt", "is required"),
    ({"prompt": "toolong"}, "prompt", "at most 5 characters"),
    ({"prompt": "a", "steps": 0}, "steps", "between 1 and 50"),
    ({"prompt": "a", "steps": "5"}, "steps", "must be an integer"),
    ({"prompt": "a", "size": 65}, "size", "multiple of 8"),
    ({"prompt": "a", "mode": "c"}, "mode", "one of ['a', 'b']"),
    ({"prompt": "a", "colour": 1}, "colour", "not an input"),
])
def test_validation_errors_name_the_field(inputs, field, fragment):
    schema = parse_manifest(BASE).inputs
    with pytest.raises(InputError) as exc:
        schema.validate(inputs)
    assert exc.value.field == field and fragment in str(exc.value)


def test_json_schema_round_trip_gives_the_same_validation():
    schema = parse_manifest(BASE).inputs
    again = InputSchema.from_json_schema(schema.json_schema())
    assert again.validate({"prompt": "hi"}) == schema.validate({"prompt": "hi"})
    with pytest.raises(InputError, match="between 1 and 50"):
        again.validate({"prompt": "hi", "steps": 99})


@pytest.mark.parametrize("change,fragment", [
    ({"name": "Bad Name"}, "name"),
    ({"version": "one"}, "version"),
    ({"output": "video"}, "output"),
    ({"work_units": "__import__('os')"}, "work_units"),
    ({"work_units": "steps * unknown"}, "work_units"),
    ({"entrypoint": "nocolon"}, "entrypoint"),
    ({"inputs": {"x": {"type": "tensor"}}}, "inputs.x.type"),
    ({"surprise": 1}, "unknown keys"),
])
def test_malformed_manifest_names_the_field(change, fragment):
    with pytest.raises(ManifestError, match=fragment.replace("(", r"\(")):
        parse_manifest({**BASE, **change})


def test_missing_field_is_named():
    data = dict(BASE)
    del data["entrypoint"]
    with pytest.raises(ManifestError, match="entrypoint is missing"):
        parse_manifest(data)


RULES = {**BASE, "rules": [
    {"field": "size", "when": "given(prompt)", "require": "floor(size / steps) >= 2",
     "message": "size over steps is {size / steps}; it must be at least 2"},
    {"field": "prompt", "require": "clip_tokens(prompt) <= 2",
     "message": "is at least {clip_tokens(prompt)} tokens; at most 2"}]}


@pytest.mark.parametrize("inputs,field,fragment", [
    ({"prompt": "a", "size": 8, "steps": 8}, "size", "size over steps is 1.0"),
    ({"prompt": "a b c"}, "prompt", "is at least 3 tokens; at most 2"),
])
def test_rules_refuse_what_the_plugin_would_with_the_values_quoted(inputs, field, fragment):
    schema = parse_manifest(RULES).inputs
    with pytest.raises(InputError) as exc:
        schema.validate(inputs)
    assert exc.value.field == field and fragment in str(exc.value)
    again = InputSchema.from_json_schema(schema.json_schema())  # what the SDK rebuilds
    with pytest.raises(InputError, match=fragment.replace("(", r"\(")):
        again.validate(inputs)
    assert again.validate({"prompt": "a b", "size": 64}) == schema.validate({"prompt": "a b",
                                                                           "size": 64})


@pytest.mark.parametrize("rule,fragment", [
    ({"field": "nope", "require": "steps > 1", "message": "m"}, "not an input"),
    ({"field": "steps", "require": "__import__('os')", "message": "m"}, "rules\\[0\\]"),
    ({"field": "steps", "require": "steps.real > 1", "message": "m"}, "Attribute"),
    ({"field": "steps", "require": "open(prompt)", "message": "m"}, "may be called"),
    ({"field": "steps", "require": "steps > 1"}, "message"),
    ({"field": "steps", "require": "steps > 1", "message": "m", "why": 1}, "unknown keys"),
    ({"field": "steps", "require": "steps > 1", "message": "{steps.x}"}, "Attribute"),
    ({"field": "steps", "require": "steps > 20", "message": "m"}, "benchmark"),
])
def test_a_malformed_rule_names_where(rule, fragment):
    with pytest.raises(ManifestError, match=fragment):
        parse_manifest({**BASE, "rules": [rule]})
