"""Atomic file output: a reader never sees a half-written file, and a crash leaves the old one in place."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import tokenize
import zipfile
from pathlib import Path

_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    """The process's umask (Python can read it only by setting it, so set it back at once)."""
    with _UMASK_LOCK:
        mask = os.umask(0o077)
        os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str | None = None):
    """Yield a temporary path beside ``path``; move it into place only if the block succeeds.

    ``suffix`` keeps writers that insist on an extension (numpy's savez, matplotlib) happy; it defaults to
    the target's own suffix. The file gets the mode ``open`` would give it (0666 less the umask), not the
    private 0600 of a temporary file, so that collaborators can read results on a shared cluster.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix or target.suffix or ".tmp", dir=target.parent)
    os.close(fd)
    try:
        os.chmod(tmp, 0o666 & ~_umask())
        yield Path(tmp)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(path: str | os.PathLike, data) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n")


def read_json(path: str | os.PathLike):
    """What ``write_json`` wrote."""
    return json.loads(Path(path).read_text())


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def read_npz(path, keys, not_ours: str) -> dict:
    """The arrays ``keys`` of an ``.npz`` file, read without unpickling anything. Otherwise a ValueError that
    starts with ``not_ours`` (e.g. "PATH is not a model written by XDGMM.save") and says what is wrong: keys
    missing, Python objects inside, or not an ``.npz`` at all."""
    import numpy as np

    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise ValueError(f"{not_ours}: it is a single array (.npy), not an .npz archive of named arrays")
        with loaded as archive:
            missing = [key for key in keys if key not in archive.files]
            if missing:
                raise ValueError(f"{not_ours}: it lacks {', '.join(missing)}")
            return {key: archive[key] for key in keys}
    except FileNotFoundError:
        raise
    except (
        OSError,
        EOFError,
        zipfile.BadZipFile,
        ValueError,
        SyntaxError,
        tokenize.TokenError,
    ) as err:  # a torn header
        if str(err).startswith(not_ours):
            raise
        if "Object arrays" in str(err):  # numpy's advice (allow_pickle) is exactly what must not be done
            raise ValueError(f"{not_ours}: it holds Python objects, which are never loaded") from None
        raise ValueError(
            f"{not_ours}: it is empty, truncated or of another format ({err.__class__.__name__})"
        ) from None
