"""Typed plugin inputs: the declaration in plugin.toml, its JSON Schema, and validation.

One module serves all sides: the broker validates a job's inputs before it writes a job row,
the SDK validates before it sends (with the same messages), and the plugin host validates
again before ``run()``. Messages name the field, quote the bad value and say what is allowed.

Declaration (``[inputs.NAME]`` tables in plugin.toml)::

    type        string | integer | number | boolean
    required    bool (default false; a field with a default is never required)
    default     value used when the field is absent
    minimum, maximum        numbers (integer / number)
    multiple_of             integer (e.g. image sides are multiples of 8)
    min_length, max_length  strings
    choices                 allowed values (any type)
    description             text shown in the schema
    default_from            "weights": the model's weights set the default (``default`` is
                            the value for the reference weights, used when none is known)

``default_from = "weights"`` is for inputs whose natural default is a property of the model
rather than of the plugin, as an image size is for diffusers (its pipelines default to the
UNet's sample size times the VAE's scale factor: 512 for SD 1.5, 64 for tiny test weights).
The plugin reports the values its weights give (``plugins.api.Plugin.input_defaults``); the
agent sends them with its capabilities, and the broker fills an input the client left out
with the value every provider that could run the job agrees on, before it prices the job,
so the job's inputs (and its work units) are explicit from then on. ``validate(inputs,
defaults=...)`` applies such values; :meth:`InputSchema.weights_defaults` checks a report.

Rules (``[[rules]]`` tables, top level in plugin.toml) say what else a plugin refuses,
across fields or beyond a type, so that every side refuses it before a provider does::

    field    the input the error names
    require  a condition over the inputs (sdk.protocol.formula): comparisons, and/or/not,
             arithmetic, min max abs floor ceil given() clip_tokens() adapter_count()
    when     optional condition: the rule applies only when it holds (by default, when
             every input ``require`` names outside given() was sent or has a default)
    message  what is wrong and what is allowed; ``{expression}`` parts are replaced by
             their value (``"is at least {clip_tokens(prompt)} tokens long; at most 75"``)

The served JSON Schema carries them as ``x-rules`` (top level, which JSON Schema readers
and older SDKs ignore), so the SDK checks them too.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import formula

TYPES = ("string", "integer", "number", "boolean")
_KEYS = {"type", "required", "default", "minimum", "maximum", "multiple_of", "min_length",
         "max_length", "choices", "description", "default_from"}
DEFAULT_FROM = ("weights",)


class InputError(ValueError):
    """Inputs that do not match a plugin's schema. ``field`` names the offending input."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.detail = message


class SchemaDeclarationError(ValueError):
    """A plugin's input declaration itself is malformed (names the manifest key)."""


@dataclass(frozen=True)
class InputSpec:
    name: str
    type: str
    required: bool = False
    default: Any = None
    minimum: float | int | None = None
    maximum: float | int | None = None
    multiple_of: int | None = None
    min_length: int | None = None
    max_length: int | None = None
    choices: tuple | None = None
    description: str = ""
    default_from: str | None = None

    @classmethod
    def from_table(cls, name: str, table: Mapping[str, Any]) -> "InputSpec":
        where = f"inputs.{name}"
        if not isinstance(table, Mapping):
            raise SchemaDeclarationError(f"{where} must be a table, got {type(table).__name__}")
        unknown = set(table) - _KEYS
        if unknown:
            raise SchemaDeclarationError(f"{where} has unknown keys {sorted(unknown)}; "
                                         f"allowed: {sorted(_KEYS)}")
        typ = table.get("type")
        if typ not in TYPES:
            raise SchemaDeclarationError(f"{where}.type is {typ!r}; must be one of {list(TYPES)}")
        choices = table.get("choices")
        spec = cls(
            name=name, type=typ, required=bool(table.get("required", False)),
            default=table.get("default"), minimum=table.get("minimum"),
            maximum=table.get("maximum"), multiple_of=table.get("multiple_of"),
            min_length=table.get("min_length"), max_length=table.get("max_length"),
            choices=tuple(choices) if choices is not None else None,
            description=str(table.get("description", "")),
            default_from=table.get("default_from"),
        )
        if spec.default_from is not None:
            if spec.default_from not in DEFAULT_FROM:
                raise SchemaDeclarationError(f"{where}.default_from is {spec.default_from!r}; "
                                             f"the only source is {DEFAULT_FROM[0]!r}")
            if spec.default is None:
                raise SchemaDeclarationError(
                    f"{where}.default_from = \"weights\" needs a default too: the value for "
                    "the reference weights, used until a provider reports its own")
        if spec.default is not None:
            try:
                spec.check(spec.default)
            except InputError as exc:
                raise SchemaDeclarationError(f"{where}.default is invalid: {exc.detail}") from None
        return spec

    # -- validation -------------------------------------------------------------------
    def check(self, value: Any) -> Any:
        """Return ``value`` coerced to the declared type, or raise InputError."""
        n = self.name
        if self.type == "boolean":
            if not isinstance(value, bool):
                raise InputError(n, f"must be true or false, got {value!r}")
        elif self.type == "integer":
            if isinstance(value, bool) or not isinstance(value, int):
                if isinstance(value, float) and value.is_integer():
                    value = int(value)
                else:
                    raise InputError(n, f"must be an integer, got {value!r}")
        elif self.type == "number":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InputError(n, f"must be a number, got {value!r}")
            value = float(value)
            if value != value or value in (float("inf"), float("-inf")):
                raise InputError(n, f"must be a finite number, got {value!r}")
        elif self.type == "string":
            if not isinstance(value, str):
                raise InputError(n, f"must be a string, got {value!r}")
            if self.min_length is not None and len(value) < self.min_length:
                raise InputError(n, f"must be at least {self.min_length} characters, "
                                    f"got {len(value)}")
            if self.max_length is not None and len(value) > self.max_length:
                raise InputError(n, f"must be at most {self.max_length} characters, "
                                    f"got {len(value)}")
        if self.type in ("integer", "number"):
            lo, hi = self.minimum, self.maximum
            if (lo is not None and value < lo) or (hi is not None and value > hi):
                rng = (f"between {lo} and {hi}" if lo is not None and hi is not None
                       else f">= {lo}" if lo is not None else f"<= {hi}")
                raise InputError(n, f"must be {rng}, got {value!r}")
            if self.multiple_of and value % self.multiple_of != 0:
                raise InputError(n, f"must be a multiple of {self.multiple_of}, got {value!r}")
        if self.choices is not None and value not in self.choices:
            raise InputError(n, f"must be one of {list(self.choices)}, got {value!r}")
        return value

    def json_schema(self) -> dict:
        js: dict[str, Any] = {"type": self.type}
        if self.description:
            js["description"] = self.description
        if self.default is not None:
            js["default"] = self.default
        for key, jkey in (("minimum", "minimum"), ("maximum", "maximum"),
                          ("multiple_of", "multipleOf"), ("min_length", "minLength"),
                          ("max_length", "maxLength")):
            if getattr(self, key) is not None:
                js[jkey] = getattr(self, key)
        if self.choices is not None:
            js["enum"] = list(self.choices)
        if self.default_from is not None:
            js["x-default-from"] = self.default_from
        return js


_RULE_KEYS = {"field", "require", "when", "message"}
_PLACEHOLDER = re.compile(r"\{([^{}]+)\}")


@dataclass(frozen=True)
class InputRule:
    """One ``[[rules]]`` table: ``require`` must hold (when ``when`` does) or the inputs are
    refused with ``message``, naming ``field``."""

    field: str
    require: str
    message: str
    when: str | None = None
    _code: Any = field(default=None, compare=False, repr=False)
    _when: Any = field(default=None, compare=False, repr=False)
    _needs: frozenset = field(default=frozenset(), compare=False, repr=False)
    _parts: tuple = field(default=(), compare=False, repr=False)

    @classmethod
    def from_table(cls, i: int, table: Any, names: set[str]) -> "InputRule":
        where = f"rules[{i}]"
        if not isinstance(table, Mapping):
            raise SchemaDeclarationError(f"{where} must be a table")
        unknown = set(table) - _RULE_KEYS
        if unknown:
            raise SchemaDeclarationError(f"{where} has unknown keys {sorted(unknown)}; "
                                         f"allowed: {sorted(_RULE_KEYS)}")
        for key in ("field", "require", "message"):
            if not isinstance(table.get(key), str) or not table[key]:
                raise SchemaDeclarationError(f"{where}.{key} must be a non-empty string")
        if table["field"] not in names:
            raise SchemaDeclarationError(f"{where}.field {table['field']!r} is not an input; "
                                         f"inputs: {sorted(names)}")
        when = table.get("when")
        if when is not None and not isinstance(when, str):
            raise SchemaDeclarationError(f"{where}.when must be a condition (a string)")
        try:
            code = formula.compile_formula(table["require"], names, condition=True)
            when_code = (formula.compile_formula(when, names, condition=True)
                         if when else None)
            parts = tuple((m.group(0), formula.compile_formula(m.group(1), names,
                                                               condition=True))
                          for m in _PLACEHOLDER.finditer(table["message"]))
        except ValueError as exc:
            raise SchemaDeclarationError(f"{where}: {exc}") from None
        needs = frozenset() if when else frozenset(
            formula.names_outside_given(table["require"]))
        return cls(table["field"], table["require"], table["message"], when, code, when_code,
                   needs, parts)

    def check(self, values: Mapping[str, Any]) -> None:
        """Raise InputError unless the rule holds for ``values`` (every input, None when
        absent), or does not apply to them."""
        if any(values.get(n) is None for n in self._needs):
            return
        try:
            if self._when is not None and not formula.evaluate(self._when, values,
                                                                condition=True):
                return
            if formula.evaluate(self._code, values, condition=True):
                return
        except ValueError as exc:  # a checking function (adapter_count()) said what is wrong
            detail = str(exc)
            raise InputError(self.field, detail.removeprefix(f"{self.field}: ")) from None
        except (TypeError, ArithmeticError):
            return  # inputs the rule cannot judge (another check refuses them if need be)
        message = self.message
        for text, code in self._parts:
            try:
                message = message.replace(text, str(formula.evaluate(code, values,
                                                                     condition=True)))
            except Exception:  # noqa: BLE001 - the message without the value still says why
                pass
        raise InputError(self.field, message)

    def to_json(self) -> dict:
        out = {"field": self.field, "require": self.require, "message": self.message}
        if self.when:
            out["when"] = self.when
        return out


@dataclass(frozen=True)
class InputSchema:
    fields: tuple[InputSpec, ...] = field(default_factory=tuple)
    rules: tuple[InputRule, ...] = field(default_factory=tuple)

    @classmethod
    def from_tables(cls, tables: Mapping[str, Any], rules: Any = ()) -> "InputSchema":
        if not isinstance(tables, Mapping):
            raise SchemaDeclarationError("inputs must be a table of [inputs.NAME] tables")
        specs = tuple(InputSpec.from_table(name, t) for name, t in tables.items())
        if not isinstance(rules, (list, tuple)):
            raise SchemaDeclarationError("rules must be an array of [[rules]] tables")
        names = {s.name for s in specs}
        clash = names & set(formula.RULE_FUNCS)
        if clash:
            raise SchemaDeclarationError(f"inputs may not be named like a function of the "
                                         f"rules: {sorted(clash)}")
        return cls(specs, tuple(InputRule.from_table(i, r, names) for i, r in enumerate(rules)))

    @classmethod
    def from_json_schema(cls, schema: Mapping[str, Any]) -> "InputSchema":
        """Rebuild from the JSON Schema the broker serves (what the SDK sees)."""
        required = set(schema.get("required", ()))
        back = {"multipleOf": "multiple_of", "minLength": "min_length",
                "maxLength": "max_length", "enum": "choices", "x-default-from": "default_from"}
        tables = {}
        for name, js in schema.get("properties", {}).items():
            # other extension keywords ("x-…") are a newer broker's: not this client's business
            t = {back.get(k, k): v for k, v in js.items()
                 if k in back or not k.startswith("x-")}
            t["required"] = name in required
            tables[name] = t
        return cls.from_tables(tables, rules=schema.get("x-rules", []))

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.fields]

    @property
    def weights_default_names(self) -> list[str]:
        """The inputs whose default the weights set (``default_from = "weights"``)."""
        return [f.name for f in self.fields if f.default_from == "weights"]

    def weights_defaults(self, reported: Any) -> dict[str, Any]:
        """``reported`` (what a plugin says its weights give) checked: a mapping of inputs
        declared ``default_from = "weights"`` to values their spec accepts. Returns the
        typed values; raises InputError naming the first input at fault."""
        if not reported:
            return {}
        if not isinstance(reported, Mapping):
            raise InputError("", f"weights defaults must be an object of input names to "
                                 f"values, got {type(reported).__name__}")
        allowed = {f.name: f for f in self.fields if f.default_from == "weights"}
        out = {}
        for name, value in reported.items():
            spec = allowed.get(name)
            if spec is None:
                raise InputError(str(name), f"is not an input whose default the weights set; "
                                            f"those are {sorted(allowed)}")
            out[spec.name] = spec.check(value)
        return out

    def validate(self, inputs: Any, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Return a complete, typed copy of ``inputs`` (defaults filled) or raise InputError.
        ``defaults``: values the weights give inputs declared ``default_from = "weights"``
        (already checked, see :meth:`weights_defaults`); they win over the declared default
        of those inputs, and only of those."""
        if not isinstance(inputs, Mapping):
            raise InputError("", f"inputs must be a JSON object, got {type(inputs).__name__}")
        known = {f.name: f for f in self.fields}
        unknown = sorted(set(inputs) - set(known))
        if unknown:
            raise InputError(unknown[0], f"is not an input of this plugin; "
                                         f"allowed inputs: {sorted(known)}")
        out: dict[str, Any] = {}
        for spec in self.fields:
            if spec.name in inputs and inputs[spec.name] is not None:
                out[spec.name] = spec.check(inputs[spec.name])
            elif defaults and spec.default_from is not None and spec.name in defaults:
                out[spec.name] = defaults[spec.name]
            elif spec.default is not None:
                out[spec.name] = spec.default
            elif spec.required:
                raise InputError(spec.name, "is required")
        if self.rules:
            values = {spec.name: out.get(spec.name) for spec in self.fields}
            for rule in self.rules:
                rule.check(values)
        return out

    def json_schema(self) -> dict:
        out = {
            "type": "object",
            "additionalProperties": False,
            "properties": {f.name: f.json_schema() for f in self.fields},
            "required": [f.name for f in self.fields if f.required and f.default is None],
        }
        if self.rules:
            out["x-rules"] = [r.to_json() for r in self.rules]
        return out
