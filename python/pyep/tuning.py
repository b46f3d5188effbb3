"""Per-machine tuned Configs: what `python -m pyep.bench --tune` found fastest, looked up by `load_tuned`.

A tuning file holds, for one device type and one group size, the best normal-mode `Config` of each
operation for each hidden size the bench tried, overall and for each SM count:

    {
      "schema": "pyep-tuning/1",
      "device": "NVIDIA H100 80GB HBM3",      # tuning.device_name(): the GPU's name, or "cpu"
      "num_ranks": 8,
      "default_hidden": 7168,                  # the entry load_tuned uses when no hidden is given
      "created": "2025-01-01T12:00:00+00:00", "pyep_version": "0.1.0",
      "source": {...},                         # how it was measured (tokens, top-k, experts, iterations)
      "hidden": {
        "7168": {
          "dispatch":     {"best": ENTRY, "by_num_sms": {"20": ENTRY, "24": ENTRY}},
          "dispatch_fp8": {...},
          "combine":      {...}
        }
      }
    }

    ENTRY = {"config": [num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv], "time_us": 123.4, "gbps": 456.7}

Where it lives: `$PYEP_TUNING_FILE` when set (one file; used only when its num_ranks matches), otherwise
`~/.cache/pyep/tuning/<device-name>-<num-ranks>.json` (the name with every run of characters other than
letters, digits, '.', '_' and '-' replaced by '_').

Files are read once per process and path and kept in memory (dispatch may ask for its config on every
call); `save` refreshes the cache, `clear_cache` forgets it. A Buffer keeps the recommended configs it
looked up until `Buffer.set_num_sms`, `save` or `clear_cache` (so a change of $PYEP_TUNING_FILE reaches a
dispatch without a config after `clear_cache`). A missing file means "not tuned" (None); an unreadable
or malformed one warns once and is treated as missing.
"""
import datetime
import json
import os
import re
import tempfile
import warnings
from typing import Dict, Optional, Tuple

from .config import Config

SCHEMA = "pyep-tuning/1"
# The operations a tuning file may hold: get_dispatch_config uses "dispatch", get_combine_config "combine".
KINDS = ("dispatch", "dispatch_fp8", "combine")
ENV_FILE = "PYEP_TUNING_FILE"

# path (as given and absolute) -> parsed file (None: missing or unusable).
_cache: Dict[str, Optional[dict]] = {}
# CUDA device index (-1: no CUDA) -> name, and (num_ranks, index) -> default path: lookups run on every
# dispatch without a config, so they must not query the driver or the file system each time.
_names: Dict[int, str] = {}
_paths: Dict[Tuple[int, int], str] = {}
_has_cuda: Optional[bool] = None


def _device_index() -> int:
    global _has_cuda
    import torch

    if _has_cuda is None:
        _has_cuda = torch.cuda.is_available()
    return torch.cuda.current_device() if _has_cuda else -1


def device_name() -> str:
    """The name tuning files are keyed by: the current CUDA device's name (`torch.cuda.get_device_name`),
    or "cpu" on a machine without CUDA."""
    index = _device_index()
    if index not in _names:
        import torch

        _names[index] = torch.cuda.get_device_name(index) if index >= 0 else "cpu"
    return _names[index]


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "unknown"


def default_path(num_ranks: int, device: Optional[str] = None) -> str:
    """`~/.cache/pyep/tuning/<device>-<num_ranks>.json` (device: `device_name()` when None)."""
    name = _slug(device if device is not None else device_name())
    return os.path.join(os.path.expanduser("~"), ".cache", "pyep", "tuning", f"{name}-{int(num_ranks)}.json")


def tuning_path(num_ranks: int, device: Optional[str] = None) -> str:
    """Where the tuning file of `num_ranks` ranks is: `$PYEP_TUNING_FILE`, or `default_path`."""
    forced = os.environ.get(ENV_FILE)
    if forced:
        return forced
    if device is not None:
        return default_path(num_ranks, device)
    key = (num_ranks, _device_index())
    path = _paths.get(key)
    if path is None:
        path = _paths[key] = default_path(num_ranks)
    return path


# Counts clear_cache calls: a Buffer keeps the recommended configs it looked up until this changes.
generation = 0


def clear_cache() -> None:
    """Forgets every file read so far; the next lookup reads the file again."""
    global generation
    _cache.clear()
    generation += 1


def _read(path: str) -> Optional[dict]:
    if path in _cache:
        return _cache[path]
    given, path = path, os.path.abspath(path)
    if path in _cache:
        _cache[given] = _cache[path]
        return _cache[path]
    data = None
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("hidden"), dict):
            warnings.warn(f"pyep: ignoring tuning file {path}: not a {SCHEMA} file", RuntimeWarning, stacklevel=3)
            data = None
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:
        warnings.warn(f"pyep: ignoring tuning file {path}: {e}", RuntimeWarning, stacklevel=3)
    _cache[path] = _cache[given] = data
    return data


def _pick_hidden(table: dict, hidden: Optional[int], default_hidden: Optional[int]) -> Optional[str]:
    sizes = sorted(int(h) for h in table)
    if not sizes:
        return None
    want = hidden if hidden is not None else default_hidden
    if want is None:
        return str(sizes[-1])
    # The tuned size nearest to the one asked for (the larger one on a tie).
    return str(min(sizes, key=lambda h: (abs(h - int(want)), -h)))


def lookup(kind: str, num_ranks: int, num_sms: Optional[int] = None, hidden: Optional[int] = None,
           path: Optional[str] = None) -> Optional[dict]:
    """The tuning ENTRY (see the module doc) behind `load_tuned`, or None."""
    if kind not in KINDS:
        raise ValueError(f"kind = {kind!r}: expected one of {', '.join(KINDS)}")
    data = _read(path or tuning_path(num_ranks))
    if data is None or data.get("num_ranks") != num_ranks:
        return None
    h = _pick_hidden(data["hidden"], hidden, data.get("default_hidden"))
    per_kind = data["hidden"].get(h, {}).get(kind) if h is not None else None
    if not isinstance(per_kind, dict):
        return None
    entry = per_kind.get("best") if num_sms is None else per_kind.get("by_num_sms", {}).get(str(num_sms))
    return entry if isinstance(entry, dict) and "config" in entry else None


def load_tuned(kind: str, num_ranks: int, num_sms: Optional[int] = None, hidden: Optional[int] = None,
               path: Optional[str] = None) -> Optional[Config]:
    """
    The tuned Config of an operation on this machine, or None when there is none.

    Arguments:
        kind: "dispatch", "dispatch_fp8" or "combine".
        num_ranks: the group size.
        num_sms: when given, the best config with exactly this many SMs (what `Buffer.get_dispatch_config`
            asks for, so that `Buffer.set_num_sms` keeps its meaning); None for the best of all SM counts.
        hidden: the hidden size; the tuned size nearest to it is used. None: the file's default_hidden.
        path: the tuning file; `tuning_path(num_ranks)` when None.

    Returns:
        config: a new `pyep.Config`, or None (no file, another group size, nothing tuned for this SM count).
    """
    entry = lookup(kind, num_ranks, num_sms, hidden, path)
    if entry is None:
        return None
    try:
        return Config(*(int(v) for v in entry["config"]))
    except (TypeError, ValueError) as e:
        warnings.warn(f"pyep: ignoring tuned {kind} config {entry['config']!r}: {e}", RuntimeWarning, stacklevel=2)
        return None


def make_table(num_ranks: int, device: str, results: Dict[Tuple[int, str], Dict[Tuple[int, ...], Tuple[float, float]]],
               default_hidden: Optional[int] = None, source: Optional[dict] = None,
               pyep_version: Optional[str] = None) -> dict:
    """
    Builds a tuning file's content from measurements.

    Arguments:
        num_ranks: the group size.
        device: the device name (`device_name()`).
        results: {(hidden, kind): {config fields (5 ints): (time_us, gbps)}}; the fastest (highest GB/s,
            then lowest time) config wins, overall and for each num_sms.
        default_hidden: the hidden size lookups without one use (the largest tuned when None).
        source: how the numbers were measured, stored as is.
        pyep_version: stored as is.
    """
    table: Dict[str, dict] = {}
    for (hidden, kind), by_config in sorted(results.items()):
        if kind not in KINDS:
            raise ValueError(f"kind = {kind!r}: expected one of {', '.join(KINDS)}")
        if not by_config:
            continue
        ranked = sorted(by_config.items(), key=lambda kv: (-kv[1][1], kv[1][0], kv[0]))

        def entry(fields, measured):
            return {"config": [int(v) for v in fields], "time_us": round(measured[0], 3), "gbps": round(measured[1], 3)}

        by_sms: Dict[str, dict] = {}
        for fields, measured in ranked:
            by_sms.setdefault(str(fields[0]), entry(fields, measured))
        table.setdefault(str(hidden), {})[kind] = {
            "best": entry(*ranked[0]),
            "by_num_sms": dict(sorted(by_sms.items(), key=lambda kv: int(kv[0]))),
        }
    hiddens = sorted(int(h) for h in table)
    if default_hidden is None and hiddens:
        default_hidden = hiddens[-1]
    return {
        "schema": SCHEMA,
        "device": device,
        "num_ranks": int(num_ranks),
        "default_hidden": default_hidden,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "pyep_version": pyep_version,
        "source": source or {},
        "hidden": table,
    }


def dumps(obj: object) -> str:
    """JSON indented for reading, with lists of numbers kept on one line."""
    text = json.dumps(obj, indent=2)
    return re.sub(r"\[\s+([-+0-9.eE,\s]+?)\s+\]",
                  lambda m: "[" + ", ".join(v.strip() for v in m.group(1).split(",")) + "]", text)


def save(table: dict, path: Optional[str] = None) -> str:
    """Writes a tuning file atomically (to `tuning_path(table["num_ranks"], table["device"])` when path is
    None), refreshes the cache and returns the path."""
    if table.get("schema") != SCHEMA:
        raise ValueError(f"table: expected a {SCHEMA} table (see make_table)")
    path = path or tuning_path(table["num_ranks"], table["device"])
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tuning-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(dumps(table) + "\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    clear_cache()  # every spelling of the path
    return path
