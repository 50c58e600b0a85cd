"""The rows of a mixture source, streamed with ``datasets`` from the Hub or from a local copy.

Every source becomes a ``datasets.IterableDataset`` of its ``train`` rows, whatever it comes
from, so one code path reads them all and ``state_dict()`` / ``load_state_dict()`` give a
position to resume from:

- the Hub: ``load_dataset(id, config, split="train", streaming=True)``;
- ``--source NAME=PATH`` with PATH a .jsonl / .jsonl.gz / .json / .parquet file or a folder
  of them (searched recursively, sorted; e.g. the dataset's files as ``huggingface-cli
  download`` writes them): ``load_dataset("json" | "parquet", data_files=..., streaming=True)``;
- PATH a folder written by ``save_to_disk`` (a Dataset, or a DatasetDict whose ``train``
  split is read): ``load_from_disk(PATH).to_iterable_dataset()``.

A local copy is identified (for resuming) by its files' sizes and mtimes, or the saved
dataset's fingerprint. Without a network, a build that needs the Hub stops before any work
with one line naming the sources to download and how to pass them.
"""
from __future__ import annotations

import json
from pathlib import Path

from .formats import check_columns
from .recipe import SourceSpec

BUILDERS = {".jsonl": "json", ".jsonl.gz": "json", ".json": "json", ".json.gz": "json",
            ".parquet": "parquet"}


def _datasets():
    try:
        import datasets
    except ImportError:
        raise ImportError("moremoe data mixture reads its sources with the datasets package: "
                          "pip install 'moremoe[text]' (or pip install datasets)") from None
    return datasets


def _builder(path: Path) -> str | None:
    return next((b for s, b in BUILDERS.items() if path.name.endswith(s)), None)


def local_origin(name: str, path: str) -> dict:
    """What a local copy is: {"path", "builder": "json" | "parquet" | "saved", "files":
    [[relative path, size, mtime_ns], ...] or "fingerprint"}; ValueError naming
    --source NAME=PATH when it is not a readable copy."""
    where = f"--source {name}={path}"
    root = Path(path).expanduser().resolve()
    if not root.exists():
        raise ValueError(f"{where}: no such file or folder")
    if root.is_dir() and ((root / "state.json").is_file() or
                          (root / "dataset_dict.json").is_file()):
        return {"path": str(root), "builder": "saved", "fingerprint": _fingerprint(root, where)}
    files = [root] if root.is_file() else sorted(
        f for f in root.rglob("*") if f.is_file() and _builder(f) and
        not any(p.startswith(".") for p in f.relative_to(root).parts))
    kinds = {_builder(f) for f in files}
    if not files or None in kinds:
        raise ValueError(f"{where}: expected a {', '.join(BUILDERS)} file, a folder of them or "
                         f"a folder written by datasets' save_to_disk")
    if len(kinds) > 1:
        raise ValueError(f"{where}: the folder mixes JSON and parquet files; give one kind")
    base = root if root.is_dir() else root.parent
    return {"path": str(root), "builder": kinds.pop(),
            "files": [[str(f.relative_to(base)), f.stat().st_size, f.stat().st_mtime_ns]
                      for f in files]}


def _fingerprint(root: Path, where: str) -> str:
    if (root / "dataset_dict.json").is_file():
        splits = json.loads((root / "dataset_dict.json").read_text())["splits"]
        if "train" not in splits:
            raise ValueError(f"{where}: the saved DatasetDict has splits {splits}, not 'train'")
        root = root / "train"
    return json.loads((root / "state.json").read_text()).get("_fingerprint", "")


def open_local(origin: dict):
    """The IterableDataset of a local copy (local_origin's description)."""
    datasets = _datasets()
    root = Path(origin["path"])
    if origin["builder"] == "saved":
        ds = datasets.load_from_disk(str(root))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"]
        return ds.to_iterable_dataset()
    base = root if root.is_dir() else root.parent
    return datasets.load_dataset(origin["builder"], split="train", streaming=True,
                                 data_files=[str(base / f) for f, _, _ in origin["files"]])


def open_hub(spec: SourceSpec):
    kw = {k: v for k, v in (("revision", spec.revision), ("data_dir", spec.data_dir)) if v}
    return _datasets().load_dataset(spec.hub, spec.config, split=spec.split, streaming=True,
                                    **kw)


def hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be reached (offline mode, no route, DNS), or None.
    One request through huggingface_hub's session (its proxies and endpoint), no retries:
    datasets itself retries for about 20 s per dataset before it gives up."""
    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE or getattr(_datasets().config, "HF_HUB_OFFLINE", False):
        return "HF_HUB_OFFLINE is set"
    from huggingface_hub.utils import get_session
    try:
        get_session().head(constants.ENDPOINT, timeout=10)
    except Exception as err:     # noqa: BLE001 - requests' or httpx's errors alike
        return f"{constants.ENDPOINT}: {' '.join(str(err).split()) or type(err).__name__}"
    return None


def _advice(specs) -> str:
    return (f"download {'it' if len(specs) == 1 else 'them'} where there is a network "
            f"(datasets.load_dataset(ID, CONFIG, split='train').save_to_disk(PATH), or the "
            f"dataset's parquet/jsonl files) and pass each with --source NAME=PATH, or leave "
            f"it out with --skip NAME; `moremoe data mixture --list` shows the ids")


def open_sources(specs, local: dict[str, dict]) -> dict:
    """{name: IterableDataset} for every spec, each checked against its formatter's columns
    on its first row. Hub sources are opened only when the Hub answers; otherwise, or when
    some cannot be opened, one ValueError names them all."""
    hub = [s for s in specs if s.name not in local]
    why = hub_unreachable() if hub else None
    if why:
        refs = ", ".join(f"{s.name}={s.hub_ref}" for s in hub)
        raise ValueError(f"the Hugging Face Hub is out of reach ({why}) and {len(hub)} "
                         f"source{'s' if len(hub) > 1 else ''} have no local copy: {refs}; "
                         f"{_advice(hub)}")
    streams, failed = {}, []
    for spec in specs:
        if spec.name in local:
            streams[spec.name] = open_local(local[spec.name])
        else:
            try:
                streams[spec.name] = open_hub(spec)
            except Exception as err:   # noqa: BLE001 - gated, renamed, a script, the network
                failed.append((spec, f"{type(err).__name__}: {' '.join(str(err).split())}"))
                continue
        where = f"source {spec.name} ({local.get(spec.name, {}).get('path', spec.hub_ref)})"
        try:
            first = next(iter(streams[spec.name].take(1)), None)
        except Exception as err:     # noqa: BLE001 - pyarrow's parse errors, the network
            raise ValueError(f"{where}: cannot read its first rows ({type(err).__name__}: "
                             f"{' '.join(str(err).split())[:300]})") from err
        if first is not None:
            check_columns(spec.format, list(first), where)
    if failed:
        what = "; ".join(f"{s.name}={s.hub_ref} ({why[:200]})" for s, why in failed)
        raise ValueError(f"cannot stream {len(failed)} source{'s' if len(failed) > 1 else ''} "
                         f"from the Hub: {what}; {_advice([s for s, _ in failed])}")
    return streams
