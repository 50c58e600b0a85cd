"""A run's configuration, composed in layers, later ones winning: a preset
(training/presets.py) or the defaults, a YAML file with the sections ``model``, ``optim`` and
``train`` (and optionally ``preset``), ``--set section.key=value`` overrides, then the train
flags of the command line. The schema and its checks are training/config.py."""
from __future__ import annotations

from pathlib import Path

from .config import SECTIONS, RunConfig, unknown
from .presets import get_preset


def _yaml():
    try:
        import yaml
    except ImportError:
        raise ImportError("config files and --set need PyYAML: pip install 'moremoe[text]'") \
            from None
    return yaml


def parse_override(text: str) -> tuple[list[str], object]:
    """'train.batch_size=16' -> (['train', 'batch_size'], 16); values are YAML scalars."""
    yaml = _yaml()
    key, sep, raw = text.partition("=")
    path = key.strip().split(".")
    if not sep or len(path) != 2 or not all(path):
        raise ValueError(f"--set expects section.key=value (e.g. train.batch_size=16), "
                         f"got {text!r}")
    try:
        return path, yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ValueError(f"--set {text}: the value {raw!r} is not a YAML value "
                         f"({_yaml_problem(err)}); quote text, e.g. {key}='\"...\"'") from None


def load_yaml(path: str | Path) -> dict:
    yaml = _yaml()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    try:
        d = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"config file {path} is not valid YAML: {_yaml_problem(err)}") from None
    except UnicodeDecodeError:
        raise ValueError(f"config file {path} is not UTF-8 text") from None
    if not isinstance(d, dict):
        raise TypeError(f"config file {str(path)!r} must hold a mapping with the sections "
                        f"{SECTIONS}, got {type(d).__name__}")
    return d


def _yaml_problem(err) -> str:
    """'expected ... at line L, column C' from a PyYAML error (lines counted from 1)."""
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(err, 'problem', None) or err}{where}"


def merge(base: dict, extra: dict, where: str = "") -> dict:
    """base updated by extra, one level of sections deep; unknown sections are errors."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    unknown(extra, ("preset",) + SECTIONS, where)
    for key, value in extra.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise TypeError(f"{key} must be a mapping of keys to values, got {value!r}")
            out.setdefault(key, {}).update(value)
        else:
            out[key] = value
    return out


def build_run_config(*, preset: str | None = None, config_file: str | None = None,
                     overrides: list[str] = (), **train_flags) -> RunConfig:
    """Preset (or the file's ``preset:``), then the YAML file, then --set, then flags
    (train.* fields given explicitly; None values are ignored)."""
    file_d = load_yaml(config_file) if config_file else {}
    name = preset if preset is not None else file_d.get("preset")
    # a preset given is a preset's name, "" included: never the defaults unannounced
    base = get_preset(name).to_dict() if name is not None else RunConfig().to_dict()
    d = merge(base, file_d)
    d["preset"] = name
    flags = {k: v for k, v in train_flags.items() if v is not None}
    return apply_overrides(d, overrides, train_flags=flags)


def apply_overrides(d: dict, overrides=(), *, train_flags: dict | None = None) -> RunConfig:
    """A run's config dict with --set section.key=value overrides, then train flags."""
    for text in overrides:
        (section, key), value = parse_override(text)
        d = merge(d, {section: {key: value}})
    if train_flags:
        d = merge(d, {"train": train_flags})
    return RunConfig.from_dict(d)
