"""A run's request to be started again later rather than failed: ``$DLRT_REQUEUE_FILE``.

A launcher that can retry a run (the Tiresias master) names a file in the run's environment.
Code inside the run that finds a shared service refusing it for now -- an AutoPS pool at
capacity, restarting or unreachable -- calls ``request(reason)`` before the run fails; the
launcher, seeing the run end with a non-zero status and the file there, queues the job
again and shows ``reason``. Outside such a launcher ``request`` does nothing. The file
holds one line of text (``clean`` bounds it), written atomically: any rank may write it.
"""
from __future__ import annotations

import os

__all__ = ["ENV", "MAX_REASON", "clean", "request"]

ENV = "DLRT_REQUEUE_FILE"
MAX_REASON = 400          # characters of a reason kept


def clean(text: str, limit: int = MAX_REASON) -> str:
    """``text`` as one line of printable characters, at most ``limit`` of them."""
    line = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def request(reason: str) -> bool:
    """Ask the launcher to requeue this run, for ``reason``; False when no launcher asked
    for such requests (``$DLRT_REQUEUE_FILE`` unset) or the file cannot be written."""
    path = os.environ.get(ENV)
    if not path:
        return False
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(clean(reason) + "\n")
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False
    return True
