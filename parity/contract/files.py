"""The one way v4parity writes an output file: atomically, durably, with one file mode.

Every output (traces and their vectors side files, `.npz` exports, ds4 logprob dumps, synthetic GGUFs,
envelopes, plots, HTML and Markdown reports, JUnit files, bench tables) goes through `atomic_write`: the
bytes go to a uniquely named temp file in the target's directory, are fsynced, the file gets mode
`OUTPUT_MODE` (0644, whatever the umask), and it is renamed over the target. A reader therefore sees the
old file or the new one, never a half-written one, and two writers of the same path never share a temp file.
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

OUTPUT_MODE = 0o644


def atomic_write(path: str | os.PathLike, write: Callable[[io.BufferedWriter], object]) -> Path:
    """Write via `write(f)` to a temp file beside `path`, fsync, chmod 0644, rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, OUTPUT_MODE)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """`atomic_write` of a bytes object."""
    return atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """`atomic_write` of UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def save_figure(fig: object, path: str | os.PathLike, dpi: int) -> Path:
    """A matplotlib figure written atomically (format from the extension) and closed."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format=Path(path).suffix.lstrip(".") or None, dpi=dpi)  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    return atomic_write_bytes(path, buf.getvalue())


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
