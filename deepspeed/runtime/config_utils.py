"""The pydantic base for every typed config section, and readable errors for bad input.

Five jobs live here, shared by `zero/config.py`, `zero/offload_config.py` and `config.py`:

- `DeepSpeedConfigModel`: strict (`extra="forbid"`) models that accept a field by its name or
  by its upstream JSON alias, and re-validate on assignment.
- Deprecated keys: a class lists old spellings in `_deprecated_keys`; they are rewritten to the
  new field before validation, with a warning on the ``deepspeed`` logger.
- `validation_error_to_value_error`: turns pydantic's `ValidationError` into one `ValueError`
  that names the full dotted key, the value given, and what is allowed.
- Honesty about what is implemented: a class lists in `_unsupported` the fields whose
  non-default values nothing here acts on, and `parse_section` rejects such a value with the
  dotted key and the supported alternative; see [Note: every key is acted on or rejected].
- Keys this package does not know: `parse_section` drops them with one warning each, and
  moves a dotted key (``"zero_optimization.reduce_bucket_size"``) into its section; see
  [Note: unknown and dotted keys].

[Note: why deprecated keys are not fields]
Upstream keeps old spellings as real fields and copies them over after validation. Here they
are rewritten before validation, so a model has exactly one attribute per option and the
old name never shows up as a stale attribute with a different value.

[Note: every key is acted on or rejected]
A config key that parses and then does nothing is worse than an error: a user who sets
``offload_optimizer`` to save memory gets an out-of-memory error instead. So each field of
every section is one of:
- acted on: some code outside the config modules reads it (tests/unit/test_config_honesty.py
  checks this by scanning the source for each field's reader);
- unsupported: listed in its class's `_unsupported` with the alternative to use; the default
  value parses, any other raises `DeepSpeedConfigError` naming the dotted key and the value;
- without effect by design: listed in `_no_effect` with the reason, for the few upstream
  tuning knobs of code paths this implementation replaces, where every value gives the same
  results and memory (``sub_group_size``: the step is element-wise and needs no sub-group
  buffers). HF, accelerate and Lightning write some of these with non-default values, so
  they cannot be rejected.
docs/config.md lists every key with what it does here.

[Note: unknown and dotted keys]
Upstream ignores top-level keys it does not know, and configs in the wild carry them: keys of
other tools (LLaMA-Factory's ``comms_config``), of newer DeepSpeed versions, and typos. So a key
that names no field is dropped before validation with one warning per key and process (rank 0),
which names the full dotted key, says it has no effect, and keeps the did-you-mean suggestion, so
that ``gradient_acumulation_steps`` is still easy to spot. This holds in every section (upstream
refuses unknown keys inside its typed sections; we warn there too). A known key set to a value
nothing here acts on is still refused (the note above): only *unknown* names are let through.

A top-level key with dots whose path names a real nested field is moved into that section
(TRL writes ``"zero_optimization.reduce_bucket_size"`` next to ``zero_optimization`` when it
prepares a reference model; upstream ignores such keys). When the section already holds the
key with a concrete value, that value wins, as upstream's would, and the warning names both:
TRL's float ``0.9 * hidden * hidden`` differs from the ``int(...)`` HF filled in, so refusing
would break every ZeRO-3 DPO run. A non-whole float for an integer field is rounded down, as HF
rounds the same formula.
"""

import dataclasses
import difflib
import enum
import logging
import math
import typing
from collections.abc import Iterator, Sequence
from pathlib import PurePath
from typing import Any, Callable, ClassVar, Optional

from pydantic import AliasChoices, BaseModel, ConfigDict, ValidationError, model_validator
from pydantic.fields import FieldInfo

from deepspeed import process_state
from deepspeed.utils.logging import log_dist, logger

__all__ = [
    "CONFIG_WARNINGS",
    "DeepSpeedConfigError",
    "DeepSpeedConfigModel",
    "DeprecatedKey",
    "Unsupported",
    "apply_dotted_keys",
    "drop_unknown_keys",
    "merge_dotted_key",
    "field_spellings",
    "find_auto_values",
    "format_loc",
    "get_scalar_param",
    "parse_section",
    "reject_auto_values",
    "reject_unsupported",
    "default_auto_values",
    "section_is_off",
    "strip_auto_values",
    "validation_error_to_value_error",
    "warn_once",
]

AUTO = "auto"


class DeepSpeedConfigError(ValueError):
    """A config that cannot be used. A `ValueError`, which is what callers catch."""


@dataclasses.dataclass(frozen=True)
class DeprecatedKey:
    """An old JSON key that still works: its value moves to `new_key` before validation.

    `convert` maps the old value to the new one; returning None means "set nothing" (for
    example ``cpu_offload: false``). `new_key=None` means the key is accepted and ignored.
    """

    new_key: Optional[str]
    convert: Optional[Callable[[Any], Any]] = None
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """A field whose non-default values this implementation does not act on.

    `alternative` tells the user what to do instead. `accepts(value)` decides which values
    parse; None accepts only the field's default.
    """

    alternative: str
    accepts: Optional[Callable[[Any], bool]] = None


def unsupported_when_true(feature: str) -> Unsupported:
    """The rule for a boolean key whose true value names `feature`, which is not implemented."""
    return Unsupported(f"{feature}; remove the key or set it to false")


def section_is_off(value: Any) -> bool:
    """True for an absent, empty or switched-off free-form section.

    A dict with an ``enabled`` key is off when that is false (other keys then do nothing);
    otherwise it is off when every value in it is off (false, zero, empty or None), so that
    a block that spells out its defaults (``{"partition_activations": false}``) parses.
    """
    if isinstance(value, dict):
        if "enabled" in value:
            return not value["enabled"]
        return all(section_is_off(item) for item in value.values())
    return not value


class DeepSpeedConfigModel(BaseModel):
    """Base of all typed config sections: strict keys, aliases, deprecated spellings.

    Parse through `parse_section` (or `get_zero_config`) for readable errors, and for the
    policy on unknown keys (warned about and dropped before this strict model sees them).
    Direct construction raises pydantic's `ValidationError`, itself a `ValueError`, on any
    unknown key: a custom `__init__` would also run for every nested section and wrap its
    errors twice.
    """

    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        validate_assignment=True,
        use_attribute_docstrings=True,
        arbitrary_types_allowed=True,
        protected_namespaces=(),
    )

    # old key -> what it becomes; each subclass sets its own.
    _deprecated_keys: ClassVar[dict[str, DeprecatedKey]] = {}
    # field name -> why non-default values are refused (see [Note: every key is acted on or rejected]).
    _unsupported: ClassVar[dict[str, Unsupported]] = {}
    # field name -> why every value behaves the same here (the same note).
    _no_effect: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _rewrite_input_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # pydantic reports the wrong type itself
        data = _migrate_deprecated(cls, dict(data))
        data = cls._rewrite_before_validation(data)
        return _collapse_duplicate_spellings(cls, data)

    @classmethod
    def _rewrite_before_validation(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Hook for rewrites that one `DeprecatedKey` cannot express; gets a private copy."""
        return data

    def __setattr__(self, name: str, value: Any) -> None:
        # validate_assignment raises pydantic's own error; give it the same readable form.
        try:
            super().__setattr__(name, value)
        except ValidationError as err:
            raise validation_error_to_value_error(err, type(self)) from None
        if name in type(self)._unsupported:
            _check_supported(self, name, "")

    @classmethod
    def valid_keys(cls) -> list[str]:
        """Every JSON key this section accepts: field names, aliases and deprecated keys."""
        keys: list[str] = []
        for name, info in cls.model_fields.items():
            keys.extend(k for k in field_spellings(name, info) if k not in keys)
        keys.extend(k for k in cls._deprecated_keys if k not in keys)
        return keys


def field_spellings(name: str, info: FieldInfo) -> list[str]:
    """The field name followed by every alias pydantic accepts for it."""
    spellings = [name]
    extra: list[Any] = [info.alias]
    if isinstance(info.validation_alias, AliasChoices):
        extra.extend(info.validation_alias.choices)
    else:
        extra.append(info.validation_alias)
    for alias in extra:
        if isinstance(alias, str) and alias not in spellings:
            spellings.append(alias)
    return spellings


def _field_key_for(cls: type[BaseModel], key: str) -> Optional[str]:
    """The field name that JSON key `key` sets in `cls`, or None when it sets nothing."""
    for name, info in cls.model_fields.items():
        if key in field_spellings(name, info):
            return name
    return None


def _migrate_deprecated(cls: type[DeepSpeedConfigModel], data: dict[str, Any]) -> dict[str, Any]:
    for old_key, spec in cls._deprecated_keys.items():
        if old_key not in data:
            continue
        old_value = data.pop(old_key)
        if spec.new_key is None:
            logger.warning(f"Config key '{old_key}' is deprecated and has no effect. {spec.note}".rstrip())
            continue
        new_value = spec.convert(old_value) if spec.convert is not None else old_value
        logger.warning(
            f"Config key '{old_key}' is deprecated; use '{spec.new_key}' instead. {spec.note}".rstrip()
        )
        if new_value is None:
            continue
        present = _present_spellings(cls, spec.new_key, data)
        if present and data[present[0]] != new_value:
            raise ValueError(
                f"deprecated key '{old_key}' ({old_value!r}) conflicts with '{present[0]}' "
                f"({data[present[0]]!r}); remove '{old_key}'"
            )
        if not present:
            data[spec.new_key] = new_value
    return data


def _present_spellings(cls: type[BaseModel], field_name: str, data: dict[str, Any]) -> list[str]:
    info = cls.model_fields.get(field_name)
    spellings = field_spellings(field_name, info) if info is not None else [field_name]
    return [key for key in spellings if key in data]


def _collapse_duplicate_spellings(cls: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    # Two spellings of one option (`bf16` and `bfloat16`) with equal values are harmless:
    # keep one, since pydantic would call the other an extra key. Different values are
    # almost always a stale key left behind by an edit, so refuse rather than guess.
    for name in cls.model_fields:
        present = _present_spellings(cls, name, data)
        if len({repr(data[key]) for key in present}) > 1:
            shown = ", ".join(f"'{key}'={data[key]!r}" for key in present)
            raise ValueError(f"{shown} all set the option '{name}' with different values; keep one")
        for key in present[1:]:
            del data[key]
    return data


# ----------------------------------------------------------------------------------------
# Errors


def format_loc(loc: Sequence[Any], prefix: str = "") -> str:
    """('zero_optimization', 'stage') -> 'zero_optimization.stage'; list indices as [i]."""
    text = prefix
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text = f"{text}.{part}" if text else str(part)
    return text


def _unwrap_model(annotation: Any) -> Optional[type[BaseModel]]:
    """The BaseModel class inside `X`, `Optional[X]` or `Union[X, ...]`, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _unwrap_model(arg)
        if found is not None:
            return found
    return None


def _walk(model_cls: type[BaseModel], loc: Sequence[Any]) -> tuple[Optional[type[BaseModel]], Any]:
    """Follow `loc` through nested models: (the model owning the last key, that key's field)."""
    owner: Optional[type[BaseModel]] = model_cls
    info = None
    for i, part in enumerate(loc):
        if owner is None or not isinstance(part, str):
            return None, None
        name = _field_key_for(owner, part)
        info = owner.model_fields.get(name) if name else None
        if i == len(loc) - 1:
            return owner, info
        owner = _unwrap_model(info.annotation) if info is not None else None
    return owner, info


def _allowed_values(info: Optional[FieldInfo]) -> Optional[str]:
    """'0 (disabled), 1 (...)' for an enum field, "'a', 'b'" for a Literal field, else None."""
    if info is None:
        return None
    candidates = [info.annotation, *typing.get_args(info.annotation)]
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, enum.Enum):
            return ", ".join(_describe_member(member) for member in candidate)
        if typing.get_origin(candidate) is typing.Literal:
            return ", ".join(repr(value) for value in typing.get_args(candidate))
    return None


def _describe_member(member: enum.Enum) -> str:
    if isinstance(member.value, str):
        return repr(member.value)
    return f"{member.value!r} ({member.name})"


def _describe_error(model_cls: type[BaseModel], error: dict[str, Any], prefix: str) -> str:
    loc = error.get("loc", ())
    key = format_loc(loc, prefix)
    kind = error.get("type", "")
    value = error.get("input")
    if kind == "extra_forbidden":
        return _describe_unknown_key(model_cls, loc, prefix)
    if kind == "value_error":
        # Raised by our own validators: the message already says what is wrong.
        message = str(error.get("ctx", {}).get("error", error.get("msg", "")))
        return f"{key}: {message}" if key else message
    got = f"{key}: got {value!r} ({type(value).__name__})"
    allowed = _allowed_values(_walk(model_cls, loc)[1])
    if allowed is not None and kind in ("enum", "literal_error"):
        # pydantic's own text repeats the choices less clearly (enum aliases show twice).
        return f"{got}; allowed values: {allowed}"
    text = f"{got}; {error.get('msg', 'invalid value')}"
    return text if allowed is None else f"{text}; allowed values: {allowed}"


def _suggestion(owner: Optional[type[BaseModel]], name: Any) -> str:
    """'; did you mean 'a' or 'b'?' for the valid keys of `owner` close to `name`, else ''."""
    if owner is None or not issubclass(owner, DeepSpeedConfigModel):
        return ""
    close = difflib.get_close_matches(str(name), owner.valid_keys(), n=3, cutoff=0.6)
    return "; did you mean " + " or ".join(repr(c) for c in close) + "?" if close else ""


def _describe_unknown_key(model_cls: type[BaseModel], loc: Sequence[Any], prefix: str) -> str:
    key = format_loc(loc, prefix)
    owner, _ = _walk(model_cls, loc)
    section = format_loc(loc[:-1], prefix)
    where = f"in '{section}'" if section else "at the top level"
    text = f"{key}: unknown key '{loc[-1]}' {where}"
    if owner is None or not issubclass(owner, DeepSpeedConfigModel):
        return text
    # A pointer, not the list: dozens of keys on one line bury the did-you-mean.
    return f"{text}{_suggestion(owner, loc[-1])} (docs/config.md lists every key and its aliases)"


def validation_error_to_value_error(
    err: ValidationError, model_cls: type[BaseModel], prefix: str = ""
) -> DeepSpeedConfigError:
    """One `ValueError` listing every problem in `err`, each under its full dotted key.

    `prefix` is the section's own key (``zero_optimization``) when `model_cls` was
    validated on its own rather than inside the whole config.
    """
    problems = [_describe_error(model_cls, error, prefix) for error in err.errors()]
    if len(problems) == 1:
        return DeepSpeedConfigError(f"Invalid DeepSpeed config: {problems[0]}")
    lines = "\n".join(f"  - {problem}" for problem in problems)
    return DeepSpeedConfigError(f"Invalid DeepSpeed config ({len(problems)} problems):\n{lines}")


def parse_section(model_cls: type[BaseModel], data: Any, prefix: str = "") -> Any:
    """`model_cls.model_validate(data)`, with errors turned into a readable `ValueError`.

    Unknown keys are dropped with a warning and dotted ones moved into their section first
    ([Note: unknown and dotted keys]). Values that nothing here acts on are refused
    (`reject_unsupported`).
    """
    data = drop_unknown_keys(model_cls, apply_dotted_keys(model_cls, {} if data is None else data), prefix)
    try:
        model = model_cls.model_validate(data)
    except ValidationError as err:
        # `from None`: the pydantic traceback repeats what the message already says.
        raise validation_error_to_value_error(err, model_cls, prefix) from None
    reject_unsupported(model, prefix)
    return model


# ----------------------------------------------------------------------------------------
# Unknown and dotted keys ([Note: unknown and dotted keys])


class _OncePerProcess:
    """Config warnings already logged: HF, zero.Init, initialize and a reference model each
    parse the same config, and one warning per key is what the user needs."""

    _seen: set[str]

    def __init__(self) -> None:
        self._seen = set()

    def warn(self, message: str) -> None:
        if message in self._seen:
            return
        self._seen.add(message)
        log_dist(message, ranks=[0], level=logging.WARNING)

    def reset(self) -> None:
        """Forget what was logged (tests that check a warning appears)."""
        self._seen.clear()


CONFIG_WARNINGS = _OncePerProcess()
process_state.register(
    "deepspeed.runtime.config_utils.CONFIG_WARNINGS", CONFIG_WARNINGS, CONFIG_WARNINGS.reset
)


def warn_once(message: str) -> None:
    """Log a config warning on rank 0, once per process for each distinct message."""
    CONFIG_WARNINGS.warn(message)


def _nested_section(model_cls: type[BaseModel], key: str) -> Optional[type[BaseModel]]:
    """The typed section class that JSON key `key` of `model_cls` holds, or None."""
    name = _field_key_for(model_cls, key)
    return _unwrap_model(model_cls.model_fields[name].annotation) if name else None


def drop_unknown_keys(model_cls: type[BaseModel], data: Any, prefix: str = "") -> Any:
    """A copy of `data` without the keys that `model_cls` and its nested sections do not know,
    each warned about once, with its dotted key and the closest valid spellings."""
    if not isinstance(data, dict) or not issubclass(model_cls, DeepSpeedConfigModel):
        return data  # pydantic reports a wrong type itself
    known = model_cls.valid_keys()
    kept: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in known:
            where = f"in '{prefix}'" if prefix else "at the top level"
            warn_once(
                f"DeepSpeed config: unknown key '{dotted}' {where} has no effect here and is "
                f"ignored{_suggestion(model_cls, key)}"
            )
            continue
        nested = _nested_section(model_cls, key)
        if nested is not None and isinstance(value, dict):
            value = drop_unknown_keys(nested, value, dotted)
        kept[key] = value
    return kept


def apply_dotted_keys(model_cls: type[BaseModel], data: Any) -> Any:
    """A copy of `data` where each key like ``"zero_optimization.reduce_bucket_size"`` that
    names a real nested field is moved into its section (`merge_dotted_key`). Dotted keys that
    name nothing stay, for `drop_unknown_keys` to warn about."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for key in list(out):
        if not isinstance(key, str) or "." not in key or key in model_cls.valid_keys():
            continue
        head, rest = key.split(".", 1)
        nested = _nested_section(model_cls, head)
        if nested is None or _walk(nested, rest.split("."))[1] is None:
            continue
        spelled = next(iter(_present_spellings(model_cls, _field_key_for(model_cls, head), out)), head)
        section = {} if out.get(spelled) is None else out[spelled]
        if isinstance(section, dict):  # a legacy `zero_optimization: true` has no keys to merge into
            out[spelled] = merge_dotted_key(nested, section, rest, out.pop(key), key)
    return out


def merge_dotted_key(model_cls: type[BaseModel], section: dict, path: str, value: Any, shown: str) -> dict:
    """A copy of `section` with `value` at `path` (dots for deeper sections), unless the section
    already sets that key to a concrete value, which wins. `shown` is the key as written."""
    if _walk(model_cls, path.split("."))[1] is None:
        return section  # names no field: left to the unknown-key warning
    section = dict(section)
    head, _, rest = path.partition(".")
    name = _field_key_for(model_cls, head)
    present = _present_spellings(model_cls, name, section)
    if rest:
        spelled = present[0] if present else head
        inner = section.get(spelled)
        if isinstance(inner, dict) or inner is None:
            section[spelled] = merge_dotted_key(
                _nested_section(model_cls, head), inner or {}, rest, value, shown
            )
        return section
    value = _round_down_for_int(model_cls.model_fields[name], value)
    current = section[present[0]] if present else AUTO
    if isinstance(current, str) and current == AUTO:
        for key in present:
            del section[key]
        section[head] = value
        warn_once(
            f"DeepSpeed config: the top-level key '{shown}' sets that nested key to {value!r}; "
            "upstream DeepSpeed ignores dotted keys, so write it inside its section"
        )
    elif current != value:
        warn_once(
            f"DeepSpeed config: the top-level key '{shown}' ({value!r}) is ignored: its section "
            f"already sets '{present[0]}' to {current!r}, which is used (upstream ignores dotted keys)"
        )
    return section


def _round_down_for_int(info: FieldInfo, value: Any) -> Any:
    # TRL writes `0.9 * hidden * hidden`; HF rounds the same formula down for the nested key.
    kinds = [info.annotation, *typing.get_args(info.annotation)]
    fractional = isinstance(value, float) and math.isfinite(value) and not value.is_integer()
    if fractional and int in kinds and float not in kinds:
        return int(value)
    return value


# ----------------------------------------------------------------------------------------
# Unsupported values


def _shown(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, PurePath):
        return str(value)
    return value


def _check_supported(model: BaseModel, name: str, prefix: str) -> None:
    rule = type(model)._unsupported[name]
    value = getattr(model, name)
    if rule.accepts is not None:
        ok = rule.accepts(value)
    else:
        ok = value == type(model).model_fields[name].get_default(call_default_factory=True)
    if not ok:
        key = f"{prefix}.{name}" if prefix else name
        raise DeepSpeedConfigError(
            f"Invalid DeepSpeed config: {key}={_shown(value)!r} is not supported by this "
            f"implementation; {rule.alternative}"
        )


def reject_unsupported(model: BaseModel, prefix: str = "") -> None:
    """Raise `DeepSpeedConfigError` for the first value, in `model` or a nested section, that
    its class lists as unsupported; the message names the dotted key, the value and the fix."""
    rules = getattr(type(model), "_unsupported", {})
    for name in type(model).model_fields:
        if name in rules:
            _check_supported(model, name, prefix)
        value = getattr(model, name)
        if isinstance(value, DeepSpeedConfigModel):
            reject_unsupported(value, f"{prefix}.{name}" if prefix else name)


# ----------------------------------------------------------------------------------------
# The HF transformers "auto" placeholder


def _iter_auto(value: Any, loc: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
    if isinstance(value, str) and value == AUTO:
        yield loc
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _iter_auto(item, (*loc, key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _iter_auto(item, (*loc, index))


def find_auto_values(data: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose value is the string "auto", in the order they appear."""
    return [format_loc(loc, prefix) for loc in _iter_auto(data, ())]


def reject_auto_values(data: Any, prefix: str = "") -> None:
    """Raise `DeepSpeedConfigError` naming every key of `data` still set to "auto"."""
    found = find_auto_values(data, prefix)
    if not found:
        return
    raise DeepSpeedConfigError(
        f'Invalid DeepSpeed config: {", ".join(found)} still set to "auto". "auto" is a placeholder '
        "that HF transformers (Trainer / HfDeepSpeedConfig) and accelerate normally resolve before "
        "DeepSpeed sees the config; replace it with a concrete value, or let the integration fill it in"
    )


def default_auto_values(data: Any, prefix: str) -> Any:
    """`strip_auto_values` for a section whose "auto" values only tune speed and memory.

    [Note: "auto" in zero_optimization] HF fills the model-size knobs of this section
    (``reduce_bucket_size``, ``stage3_prefetch_bucket_size``, ...) only when the Trainer
    prepares the model it trains; an engine built earlier from the same config (TRL's
    reference model at stages 0-2) still carries "auto" there. Upstream takes its defaults
    for them, and none of them changes what is computed, so we do the same, warning once
    per key. "auto" anywhere else (learning rate, batch sizes, clipping) is still refused.
    """
    for key in find_auto_values(data, prefix):
        warn_once(f'DeepSpeed config: {key} is "auto" and nothing filled it; its default applies')
    return strip_auto_values(data)


def strip_auto_values(data: Any) -> Any:
    """A copy of `data` with every "auto" entry removed, so that defaults apply instead.

    A list item that is "auto" (``"betas": ["auto", 0.99]``) is kept: dropping it would
    shift the items after it.
    """
    if isinstance(data, dict):
        return {k: strip_auto_values(v) for k, v in data.items() if not (isinstance(v, str) and v == AUTO)}
    if isinstance(data, list):
        return [strip_auto_values(v) for v in data]
    return data


def get_scalar_param(param_dict: dict[str, Any], key: str, default: Any) -> Any:
    """`param_dict.get(key, default)`; kept because upstream helpers and callers use it."""
    return param_dict.get(key, default)
