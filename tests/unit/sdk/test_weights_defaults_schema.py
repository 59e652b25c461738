"""Inputs whose default the model's weights set (``default_from = "weights"``): declared in
the manifest with the reference weights' value, reported by a plugin, applied by
``validate(inputs, defaults=...)`` to those inputs only (issue #30: the README's first
example at the size the demo's tiny weights are made for)."""
import pytest

from sdk.protocol.manifest import ManifestError, load_manifest, parse_manifest
from sdk.protocol.schema import InputError, InputSchema

SIZE = {"type": "integer", "default": 512, "minimum": 64, "maximum": 1024, "multiple_of": 8,
        "default_from": "weights"}
BASE = {"name": "p", "version": "1.0.0", "publisher": "x", "entrypoint": "plugin:P",
        "output": "images", "work_units": "steps * width * height / 1048576",
        "inputs": {"prompt": {"type": "string", "required": True},
                   "steps": {"type": "integer", "default": 30},
                   "width": SIZE, "height": SIZE},
        "benchmark": {"inputs": {"prompt": "a"}}}


def test_the_built_in_image_plugins_let_the_weights_set_the_size():
    for name, real in (("sd15", 512), ("sdxl", 1024)):
        m = load_manifest(f"plugins/{name}")
        assert m.inputs.weights_default_names == ["width", "height"]
        # with nothing known of the weights: the real model's size
        assert m.validate_inputs({"prompt": "a"})["width"] == real
        assert m.to_public()["input_schema"]["properties"]["width"]["x-default-from"] == "weights"
    assert load_manifest("plugins/llama").inputs.weights_default_names == []


def test_weights_defaults_fill_only_what_the_client_left_out():
    m = parse_manifest(BASE)
    got = m.validate_inputs({"prompt": "a"}, {"width": 64, "height": 64})
    assert (got["width"], got["height"], got["steps"]) == (64, 64, 30)
    assert m.work_units_for(got) == 30 * 64 * 64 / 1048576
    asked = m.validate_inputs({"prompt": "a", "width": 256}, {"width": 64, "height": 64})
    assert (asked["width"], asked["height"]) == (256, 64)
    # an input not declared default_from = "weights" keeps its own default
    assert m.validate_inputs({"prompt": "a"}, {"steps": 5})["steps"] == 30


@pytest.mark.parametrize("report,field,fragment", [
    ({"width": 68}, "width", "multiple of 8"),
    ({"width": 4096}, "width", "between 64 and 1024"),
    ({"steps": 5}, "steps", "not an input whose default the weights set"),
    ({"width": "64"}, "width", "must be an integer"),
    ([64], "", "must be an object"),
])
def test_a_report_the_schema_refuses_is_named(report, field, fragment):
    schema = parse_manifest(BASE).inputs
    with pytest.raises(InputError) as exc:
        schema.weights_defaults(report)
    assert exc.value.field == field and fragment in str(exc.value)
    assert schema.weights_defaults({"width": 64.0}) == {"width": 64}
    assert schema.weights_defaults({}) == {} and schema.weights_defaults(None) == {}


@pytest.mark.parametrize("table,fragment", [
    ({"type": "integer", "default_from": "weights"}, "needs a default too"),
    ({"type": "integer", "default": 8, "default_from": "model"}, "the only source is 'weights'"),
])
def test_a_bad_declaration_is_named(table, fragment):
    with pytest.raises(ManifestError, match=fragment):
        parse_manifest({**BASE, "inputs": {**BASE["inputs"], "width": table}})


def test_the_json_schema_keeps_the_declaration_and_ignores_other_extensions():
    schema = parse_manifest(BASE).inputs
    js = schema.json_schema()
    again = InputSchema.from_json_schema(js)
    assert again.weights_default_names == ["width", "height"]
    js["properties"]["steps"]["x-newer-broker"] = True  # an extension this client predates
    assert InputSchema.from_json_schema(js).validate({"prompt": "a"})["steps"] == 30
