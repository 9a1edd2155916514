"""The content-addressed, deduplicating snapshot repository (docs/format.md).

The names below are resolved on first use (PEP 562): `from gpusnap.repo import locate` on
restore's path must not load the dump side (the page pipeline, its writer and pack writer).
"""

__all__ = ["Repository", "Snapshot"]

_WHERE = {"Repository": "gpusnap.repo.repository", "Snapshot": "gpusnap.repo.snapshot"}


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
