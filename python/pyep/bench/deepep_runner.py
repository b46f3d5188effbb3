"""DeepEP V1 beside pyep: importing it."""
import importlib
import os
from typing import Tuple

import pyep


def _import_deepep() -> Tuple[object, dict]:
    """(module or None, {"version", "skipped"}) for DeepEP; never raises."""
    try:
        mod = importlib.import_module("deep_ep")
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
        return None, {"version": None, "skipped": f"import deep_ep failed: {type(e).__name__}: {e}"}
    if mod is pyep or getattr(mod, "__name__", "") == "pyep" or os.path.dirname(getattr(mod, "__file__", "") or "") == os.path.dirname(pyep.__file__):
        return None, {"version": None, "skipped": "deep_ep is pyep itself"}
    version = getattr(mod, "__version__", None)
    if version is None:
        try:
            from importlib import metadata
            for dist_name in ("deep_ep", "deep-ep", "deepep"):
                try:
                    version = metadata.version(dist_name)
                    break
                except metadata.PackageNotFoundError:
                    continue
        except ImportError:
            pass
    return mod, {"version": version, "skipped": None}
