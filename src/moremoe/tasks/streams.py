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

import contextlib
import json
import logging
from pathlib import Path

from .file_faults import file_fault
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
    config = _datasets().config            # datasets < 2.21 names it HF_DATASETS_OFFLINE
    if constants.HF_HUB_OFFLINE or any(getattr(config, name, False)
                                       for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
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
    some cannot be opened, one ValueError names them all. A local copy that cannot be read
    or holds no rows is a ValueError naming the source and the file (read_failure)."""
    hub = [s for s in specs if s.name not in local]
    why = hub_unreachable() if hub else None
    if why:
        refs = ", ".join(f"{s.name}={s.hub_ref}" for s in hub)
        raise ValueError(f"the Hugging Face Hub is out of reach ({why}) and {len(hub)} "
                         f"source{'s' if len(hub) > 1 else ''} have no local copy: {refs}; "
                         f"{_advice(hub)}")
    streams, failed = {}, []
    for spec in specs:
        origin = local.get(spec.name)
        if origin is not None:
            try:
                streams[spec.name] = open_local(origin)
                first = next(iter(streams[spec.name].take(1)), None)
            except Exception as err:   # noqa: BLE001 - datasets' and pyarrow's, StopIteration
                raise ValueError(read_failure(spec.name, origin, err)) from err
            if first is None:       # older datasets read an empty file as no rows
                why = read_failure(spec.name, origin, None, only_files=True)
                if why:
                    raise ValueError(why)
                raise ValueError(f"source {spec.name} ({origin['path']}): the local copy is "
                                 f"empty (no rows); give a copy that holds the source's rows, "
                                 f"or leave it out with --skip {spec.name}")
        else:
            try:
                streams[spec.name] = open_hub(spec)
            except Exception as err:   # noqa: BLE001 - gated, renamed, a script, the network
                failed.append((spec, f"{type(err).__name__}: {' '.join(str(err).split())}"))
                continue
            try:
                first = next(iter(streams[spec.name].take(1)), None)
            except Exception as err:     # noqa: BLE001 - pyarrow's parse errors, the network
                raise ValueError(f"source {spec.name} ({spec.hub_ref}): cannot read its first "
                                 f"rows ({type(err).__name__}: "
                                 f"{' '.join(str(err).split())[:300]})") from err
        if first is not None:
            check_columns(spec.format, list(first),
                          f"source {spec.name} ({origin['path'] if origin else spec.hub_ref})")
    if failed:
        what = "; ".join(f"{s.name}={s.hub_ref} ({why[:200]})" for s, why in failed)
        raise ValueError(f"cannot stream {len(failed)} source{'s' if len(failed) > 1 else ''} "
                         f"from the Hub: {what}; {_advice([s for s, _ in failed])}")
    return streams


def read_failure(name: str, origin: dict, err: BaseException | None, *,
                 only_files: bool = False) -> str | None:
    """Why a local copy could not be read, naming the source and, where one is at fault, the
    file and line (tasks/file_faults.py); datasets' own error when no file is found at
    fault (a saved dataset, a schema that changes between files), or None with
    ``only_files``."""
    if origin["builder"] != "saved":
        root = Path(origin["path"])
        base = root if root.is_dir() else root.parent
        for rel, _, _ in origin["files"]:
            why = file_fault(base / rel)
            if why:
                do = ("give a copy that holds its rows" if why == "the file is empty" else
                      "give one JSON object per row" if "not an object" in why else
                      "download it again")
                return f"source {name} ({base / rel}): {why}; {do}, or leave the source out " \
                       f"with --skip {name}"
    if only_files:
        return None
    text = " ".join(str(err).split())[:300] or "no message"
    return (f"source {name} ({origin['path']}): cannot read it ({type(err).__name__}: {text}); "
            f"give a complete copy in the source's Hub schema, one schema in every file")


@contextlib.contextmanager
def quiet_datasets():
    """Hold back datasets' own log lines (it logs a read error before raising it): the error
    it raises is reported, as one line. datasets sets its level when first imported, so it
    is imported first."""
    with contextlib.suppress(ImportError):
        import datasets  # noqa: F401
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
