"""Recipe options: one typed config per recipe, made of sections (model, data, optim, parallel, checkpoint, ...), read
from defaults < a TOML/YAML file (--config) < the command line.

A section is a dataclass of options; a recipe's config (in its own file: `PretrainConfig` in recipes/pretrain.py ...)
is a dataclass of sections, each made by `section(...)` with that recipe's defaults (and, where an option means
something more specific there, its wording of the help). Flags stay flat: every field is a flag named after it
(`seq_len` -> `--seq-len`, booleans also as `--no-...`) unless its `opt` names another (`name` in the model section
is `--model`), listed with its help by --help. A config file sets the same options by their flat names
(`seq-len = 512` or `seq_len = 512`), or by section (`[optim]` then `lr = 3e-4`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from zoo.errors import ArgumentParser, ZooError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# a range check: the value -> what was wanted, or None when it is in range
Check = Callable[[Any], "str | None"]


def at_least(low: int) -> Check:
    return lambda v: None if v >= low else f"at least {low}"


def between(low: int, high: int) -> Check:
    return lambda v: None if low <= v <= high else f"an integer in {low}..{high}"


def positive(v: float) -> str | None:
    return None if math.isfinite(v) and v > 0 else "a finite number above 0"


def non_negative(v: float) -> str | None:
    return None if math.isfinite(v) and v >= 0 else "a finite number, at least 0"


def fraction(v: float) -> str | None:
    return non_negative(v) or (None if v <= 1 else "between 0 and 1")


def a_directory(v: str) -> str | None:
    """An output directory: new, or one that exists as a directory (a file there would be replaced or mistaken)."""
    return None if not Path(v).exists() or Path(v).is_dir() else "a directory (new, or an earlier run's), not a file"


def program(cls: type) -> str:
    """How the recipe of config class `cls` is started: `python -m recipes.sft`, not `sft.py`; a recipe that is a
    package with a `__main__` (recipes/dpo/, its config in recipes/dpo/config.py) as the package."""
    module = cls.__module__
    if module == "__main__":  # python -m recipes.sft runs the module as __main__; its spec keeps the real name
        spec = sys.modules["__main__"].__spec__
        module = spec.name if spec is not None else Path(sys.argv[0]).stem
    package = module.rpartition(".")[0]
    if package and importlib.util.find_spec(f"{package}.__main__") is not None:
        module = package
    return f"python -m {module}"


def opt(default: Any, help: str, choices: tuple[Any, ...] | None = None, *, flag: str | None = None,
        check: Check | None = None) -> Any:
    """A section's option: its default, its --help text, the values it accepts (`choices`, or a range `check`, so a
    zero batch or a NaN learning rate cannot "train" silently), and its flag when that is not `--<name>`."""
    return field(default=default, metadata={"help": help, "choices": choices, "flag": flag, "check": check})


class Section:
    """A recipe config or one of its sections: an attribute that is none of its fields (a misspelt
    `cfg.optim.learning_rate = 1e-4`, which the recipe would never read) is refused on assignment, naming the
    fields. dataclasses' __init__ and replace() set fields only; copy.deepcopy sets none."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        names = getattr(type(self), "__dataclass_fields__", {})
        if name not in names:
            near = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {near[0]}?" if near else f"its fields: {', '.join(names)}"
            raise ZooError(f"{type(self).__name__} has no field {name!r} ({hint})")
        object.__setattr__(self, name, value)


S = TypeVar("S")


def section(make: Callable[[], S], help: dict[str, str] | None = None) -> S:
    """A recipe's section, as `make` builds it: the section class (its own defaults) or the section with this
    recipe's (`section(lambda: OptimSection(lr=1e-3))`); `help` rewords options that mean something more specific
    in this recipe (by field name)."""
    return field(default_factory=make, metadata={"help": help or {}})


@dataclass(frozen=True)
class Option:
    """One flag: the section and field it sets, and what it accepts."""

    section: str
    field: str
    name: str  # the flat name: the flag without its dashes, "-" as "_" (a config file's key)
    flag: str
    kind: type
    default: Any
    help: str
    choices: tuple[Any, ...] | None
    check: Check | None
    optional: bool = False  # None is a value (its type is `X | None`)


def _flag(f: dataclasses.Field[Any]) -> str:
    flag: str | None = f.metadata["flag"]
    return flag or "--" + f.name.replace("_", "-")


def options(cfg: DataclassInstance) -> list[Option]:
    """The flags of a recipe config, section by section, with `cfg`'s values as their defaults."""
    out = []
    for s in dataclasses.fields(cfg):
        values = vars(cfg)[s.name]
        names = {f.name for f in dataclasses.fields(values)}
        if not set(s.metadata.get("help", {})) <= names:
            raise ValueError(f"{type(cfg).__name__}.{s.name}: help for {set(s.metadata['help']) - names}, which "
                             f"{type(values).__name__} does not have")
        for f in dataclasses.fields(values):
            default, flag = vars(values)[f.name], _flag(f)
            out.append(Option(s.name, f.name, flag[2:].replace("-", "_"), flag,
                              type(default) if default is not None else str, default,
                              s.metadata.get("help", {}).get(f.name, f.metadata["help"]), f.metadata["choices"],
                              f.metadata["check"], "None" in str(f.type)))
    return out


def flags(values: DataclassInstance) -> dict[str, Any]:
    """{flat name: value} of one section's options."""
    return {_flag(f)[2:].replace("-", "_"): vars(values)[f.name] for f in dataclasses.fields(values)}


def flat(cfg: DataclassInstance) -> dict[str, Any]:
    """{flat name: value} of every option of a recipe config: what a checkpoint records of the run that wrote it."""
    return {k: v for s in dataclasses.fields(cfg) for k, v in flags(vars(cfg)[s.name]).items()}


MAX_CONFIG_BYTES = 1 << 20  # a config file is a screenful of options; a bigger one was named by mistake


def _read_file(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise ZooError(f"config file {p} not found")
    if not p.is_file():
        raise ZooError(f"config file {p}: expected a regular file (TOML, YAML or JSON), got a "
                       f"{'directory' if p.is_dir() else 'special file'}")
    if p.suffix not in (".toml", ".yaml", ".yml", ".json"):
        raise ZooError(f"{p}: config files are .toml, .yaml/.yml or .json, got {p.suffix!r}")
    with p.open("rb") as fh:
        raw = fh.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ZooError(f"config file {p}: expected at most {MAX_CONFIG_BYTES:,} bytes of options, got a bigger file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ZooError(f"config file {p}: not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start})") from e
    values: Any
    if p.suffix == ".toml":
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # Python 3.10: the same parser, as the tomli package
            import tomli as tomllib

        try:
            values = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ZooError(f"{p}: not valid TOML ({e})") from e
    elif p.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as e:
            raise ZooError(f"{p}: reading YAML needs PyYAML (pip install pyyaml), or write the config as TOML") from e
        try:
            values = yaml.safe_load(text)
        except (yaml.YAMLError, RecursionError) as e:
            raise ZooError(f"{p}: not valid YAML ({' '.join(str(e).split())[:200]})") from e
        values = {} if values is None else values
    else:
        try:
            values = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise ZooError(f"{p}: not valid JSON ({str(e)[:200]})") from e
    if not isinstance(values, dict):
        raise ZooError(f"{p}: expected a mapping of option names to values, got {type(values).__name__}")
    return values


def file_values(path: str, opts: list[Option]) -> dict[str, Any]:
    """{flat name: value} of a config file, its values checked against the options' types. Keys are flat names
    (`seq-len`, `seq_len`), or a section's table (`[optim]`) of its field or flat names."""
    by_name = {o.name: o for o in opts}
    sections = {o.section for o in opts}
    values: dict[str, Any] = {}
    unknown = []
    for key, value in _read_file(path).items():
        key = str(key).replace("-", "_")  # YAML keys may be numbers or booleans
        if key in sections and isinstance(value, dict):
            fields = {o.field: o.name for o in opts if o.section == key} | {o.name: o.name for o in opts
                                                                               if o.section == key}
            for k, v in value.items():
                k = str(k).replace("-", "_")
                if k in fields:
                    values[fields[k]] = v
                else:
                    unknown.append(f"{key}.{k}")
        elif key in by_name:
            values[key] = value
        else:
            unknown.append(key)
    if unknown:
        raise ZooError(f"{path}: unknown options {', '.join(sorted(unknown))}; known: {', '.join(sorted(by_name))}")
    for k, v in values.items():
        kind = by_name[k].kind
        if v is None:
            continue
        if kind in (int, float) and isinstance(v, str):  # PyYAML reads `lr: 5e-3` (no dot) as the string '5e-3'
            v = values[k] = _numeric(v)
        if kind is bool and not isinstance(v, bool):
            raise ZooError(f"{path}: option {k} must be true or false, got {v!r}")
        if kind in (int, float) and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ZooError(f"{path}: option {k} must be a number, got {v!r}")
        if kind is int and not isinstance(v, int):  # steps = 1e3 or seq_len = 1.5: a count is an integer
            raise ZooError(f"{path}: option {k} must be an integer, got {v!r}")
        if kind is str and not isinstance(v, str):
            raise ZooError(f"{path}: option {k} must be a string, got {v!r}")
    return {k: v for k, v in values.items() if v is not None}


def _numeric(text: str) -> int | float | str:
    """The finite number a config file's string spells ('5e-3', '100'), else the string, for the caller to name."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        return text
    return number if math.isfinite(number) else text


C = TypeVar("C", bound="DataclassInstance")


def parse(cls: type[C], argv: list[str] | None = None, doc: str | None = None) -> C:
    """A recipe's config from defaults < --config FILE < flags; every value checked (choices and ranges), a bad
    one named by its flag. --help describes the recipe by the first line of `doc` (its module's docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    pre = ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)

    defaults = cls()
    opts = options(defaults)
    p = ArgumentParser(prog=program(cls), description=(doc or "").split("\n")[0])
    p.add_argument("--config", help="TOML or YAML file of options (flags given too override it)")
    for o in opts:
        help = o.help + ("" if o.default is None else f" (default: {o.default})")
        if o.kind is bool:
            p.add_argument(o.flag, action=argparse.BooleanOptionalAction, default=o.default, help=help)
        else:
            p.add_argument(o.flag, type=o.kind, default=o.default, help=help, choices=o.choices)
    if known.config:
        p.set_defaults(**file_values(known.config, opts))
    args = vars(p.parse_args(argv))
    sections = {s.name: replace(vars(defaults)[s.name], **{o.field: args[o.name] for o in opts if o.section == s.name})
                for s in dataclasses.fields(defaults)}
    cfg = cls(**sections)
    check(cfg)
    return cfg


def check(cfg: DataclassInstance, expected: type | None = None) -> None:
    """Every option of a recipe config against its declared type (the recipe's defaults' types; an int passes for a
    float), its choices and its range: what `parse` checks of the command line and a config file, and what a
    recipe's `run(cfg)` checks of a config built in Python (`expected`: its config class). A bad one is a ZooError
    naming its flag."""
    if expected is not None and type(cfg) is not expected:  # sft.run(DPOConfig()) would train on DPO's defaults
        raise ZooError(f"run() expects its recipe's config class {expected.__name__}, got {type(cfg).__name__}")
    defaults = type(cfg)()
    for s in dataclasses.fields(cfg):  # a dict, None or another section where a section belongs
        cls, got = type(vars(defaults)[s.name]), vars(cfg)[s.name]
        if not isinstance(got, cls):
            raise ZooError(f"{type(cfg).__name__}.{s.name} must be a section of class {cls.__name__}, got "
                           f"{type(got).__name__}")
    kinds = {o.name: o.kind for o in options(defaults)}
    for o in options(cfg):
        value, kind = o.default, kinds[o.name]
        wanted = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(kind, kind)
        if value is None and not o.optional:
            raise ZooError(f"{o.flag} must be {wanted}, got None")
        number = kind is float and isinstance(value, int) and not isinstance(value, bool)
        wrong_type = not isinstance(value, kind) or (kind is int and isinstance(value, bool))
        if value is not None and not number and wrong_type:
            raise ZooError(f"{o.flag} must be {wanted}, got {value!r} ({type(value).__name__})")
        if o.choices and value not in o.choices:
            raise ZooError(f"option {o.name} must be one of {', '.join(map(str, o.choices))}, got {value!r}")
        want = o.check(value) if o.check is not None and value is not None else None
        if want is not None:
            raise ZooError(f"{o.flag} must be {want}, got {value!r}")

