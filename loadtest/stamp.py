"""The stamp that ties a result record to the code that produced it: commit, dirty flag, UTC date.

Every benchmark line (``emit``) and every A/B run and report carry it, so a published number
traces to a file and a commit. Standard library only: benchmarks import it on GPU hosts that have
just torch, numpy and msgpack, and often no git or no ``.git`` (the tree is copied there): there the
commit comes from ``$KVGATE_COMMIT`` (``dirty`` then unknown: null), else it is "unknown".
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(("git", *args), cwd=ROOT, capture_output=True, text=True, check=True,
                              timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None


@functools.cache
def commit() -> tuple[str, bool | None]:
    """(commit sha, whether tracked files differ from it); read once per process."""
    if sha := os.environ.get("KVGATE_COMMIT"):
        return sha, None
    head = _git("rev-parse", "HEAD")
    if head is None:
        return "unknown", None
    status = _git("status", "--porcelain", "--untracked-files=no")  # new result files are not changes
    return head.strip(), None if status is None else bool(status.strip())


def stamp() -> dict[str, str | bool | None]:
    sha, dirty = commit()
    return {"commit": sha, "dirty": dirty,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def emit(**fields: object) -> None:
    """Print one benchmark record: a JSON line of ``fields`` and the stamp."""
    print(json.dumps({**fields, **stamp()}), flush=True)
