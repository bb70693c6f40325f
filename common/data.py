"""Real text, byte-level tokens, and a loader that gives every world size the same batches.

Tokens are raw bytes (vocabulary 256), so there is no tokenizer to download. The default
corpus is the source of the running Python's standard library, found on disk: about 30 MB
of real, structured text on any machine that can run this tutorial. Real data at scale is
tokenized once by ``python -m tools.prepare_data`` into a folder that ``--data`` also takes:
then the token streams are memory-mapped shards (common/prepared.py), read window by window.

The loader is a ``DistributedSampler`` (``WindowOrder``: its order, resumable in place) plus
a ``DataLoader``. With ``drop_last`` and a
per-rank batch of ``global_batch / dp_size``, global batch k is the set
``perm[k*B:(k+1)*B]`` of one seeded permutation whatever the number of data-parallel
ranks (rank r takes every dp_size-th index of it). That is what lets the tests compare a
4-rank run with a 1-process run sample for sample.
"""
from __future__ import annotations

import sysconfig
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from common import prepared
from common.errors import UserError

VAL_EVERY = 20  # one file in 20 (by a hash of its path) is held out for validation
SYNTHETIC_TOKENS = 4_000_000


@dataclass
class Corpus:
    name: str
    # token ids: uint8 bytes (int32 for a synthetic vocabulary beyond 256), or a prepared
    # folder's prepared.TokenStream (len() and slices, like a tensor, from memory-mapped shards)
    train: torch.Tensor
    val: torch.Tensor
    train_files: list[str]
    val_files: list[str]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files() -> tuple[Path, list[Path]]:
    root = stdlib_root()
    files = [p for p in root.rglob("*.py")
             if not {"site-packages", "dist-packages", "__pycache__"} & set(p.relative_to(root).parts)]
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _text_files(path: Path) -> tuple[Path, list[Path]]:
    if not path.exists():
        raise UserError(f"--data {path}: no such file or folder; give a text file, a folder of them, "
                        f"'stdlib' or 'synthetic'.")
    if path.is_file():
        return path.parent, [path]
    files = sorted((p for p in path.rglob("*") if p.is_file() and not any(s.startswith(".") for s in p.relative_to(path).parts)),
                   key=lambda p: p.relative_to(path).as_posix())
    return path, files


def _split(root: Path, files: list[Path]) -> tuple[list[Path], list[Path]]:
    """Hold out whole files (never a file split between train and val)."""
    if len(files) == 1:
        return files, []
    val = [p for p in files if zlib.crc32(p.relative_to(root).as_posix().encode()) % VAL_EVERY == 0]
    if not val:
        val = files[-1:]
    val_set = set(val)
    return [p for p in files if p not in val_set], val


def _read(files: list[Path], what: str) -> torch.Tensor:
    chunks = []
    for p in files:
        try:
            chunks.append(p.read_bytes())
        except OSError as e:
            raise UserError(f"--data: cannot read {p} ({e.strerror}).") from None
    data = b"".join(chunks)
    if not data:
        raise UserError(f"--data {what}: the text is empty; give a file or folder with some text in it.")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


# The stdlib does not change while a process runs: runs that share a process (tools/multirun.py)
# read it once. A path is read again every time, since its files may change in between.
_CACHE: dict[str, Corpus] = {}


def load_corpus(spec: str, seed: int = 0, vocab_size: int = 256) -> Corpus:
    """``stdlib`` (default), ``synthetic`` (seeded random token ids below ``vocab_size``: bytes
    by default), a prepared folder (``vocab_size`` its tokenizer's, which cli.parse sets), or
    a path to text (bytes: ``vocab_size`` must be 256, cli.check_vocab_size)."""
    if spec == "synthetic":
        g = torch.Generator().manual_seed(seed)
        dtype = torch.uint8 if vocab_size <= 256 else torch.int32  # the default draws the same bytes as ever
        tokens = torch.randint(0, vocab_size, (SYNTHETIC_TOKENS,), generator=g, dtype=dtype)
        cut = int(len(tokens) * (1 - 1 / VAL_EVERY))
        return Corpus("synthetic", tokens[:cut], tokens[cut:], [], [])
    if prepared.is_prepared(spec):
        return Corpus(spec, *prepared.open_splits(spec, vocab_size))
    if spec != "stdlib" and Path(spec).is_dir() and prepared.looks_prepared(Path(spec)):
        raise UserError(f"--data {spec} holds token shards or a tokenizer but no {prepared.META}: it is not a "
                        f"complete prepared folder; prepare it again (python -m tools.prepare_data).")
    if vocab_size != 256:
        raise UserError(f"--vocab-size {vocab_size} needs --data synthetic or a prepared folder: text is read as "
                        f"bytes (256 tokens).")
    if spec == "stdlib" and "stdlib" in _CACHE:
        return _CACHE["stdlib"]
    root, files = _stdlib_files() if spec == "stdlib" else _text_files(Path(spec))
    if not files:
        raise UserError(f"--data {spec}: found no files to read; give a text file or a folder of them.")
    train_files, val_files = _split(root, files)
    train = _read(train_files, spec)
    if val_files:
        val = _read(val_files, spec)
    else:  # a single file: hold out its last 5% instead
        cut = int(len(train) * (1 - 1 / VAL_EVERY))
        train, val = train[:cut], train[cut:]
    rel = lambda ps: [p.relative_to(root).as_posix() for p in ps]  # noqa: E731
    corpus = Corpus(spec, train, val, rel(train_files), rel(val_files))
    if spec == "stdlib":
        _CACHE["stdlib"] = corpus
    return corpus


class TokenWindows(Dataset):
    """Non-overlapping windows of seq_len + 1 tokens: inputs and next-token targets."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self):
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i):
        w = self.tokens[i * self.seq_len: (i + 1) * self.seq_len + 1].long()
        return w[:-1], w[1:]

    def will_need(self, windows: list[int]) -> None:
        """Have these windows read from the disk in the background (shards on disk only)."""
        if hasattr(self.tokens, "will_need"):
            for i in windows:
                self.tokens.will_need(i * self.seq_len, (i + 1) * self.seq_len + 1)


def pins_for(device: torch.device | str) -> bool:
    """Whether a run on ``device`` stages its batches in pinned (page-locked) memory: a CUDA
    run's only. The GPU copies from pinned memory by itself, so the scripts'
    ``.to(device, non_blocking=True)`` returns at once; a copy from ordinary memory makes the
    host wait. A CPU run pins nothing, even in a process where CUDA is initialised."""
    # CUDA path:
    # tests/test_data.py::test_a_cuda_run_pins_its_batches_and_a_cpu_run_does_not_even_with_cuda_initialised
    return torch.device(device).type == "cuda"


class WindowOrder(DistributedSampler):
    """PyTorch's ``DistributedSampler`` order, read from any position and kept as a tensor.

    The same windows in the same order as its parent (tests/test_data.py holds them equal),
    with two changes for a corpus of billions of tokens: the epoch's permutation stays a
    tensor (8 bytes a window; the parent makes a Python list of every index, about 36 bytes
    each, then a second one of this rank's), and ``start`` skips this rank's first windows
    without reading them (a resumed run begins at its batch at once, instead of loading every
    batch it already trained on).
    """

    start = 0  # this rank's windows to skip in this epoch
    ahead = 0  # windows a batch: when a batch's are handed out, the next batch's are read ahead

    def __iter__(self):
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g)
        else:
            order = torch.arange(n)
        mine = order[:self.total_size][self.rank::self.num_replicas][self.start:]  # (drop_last: Batches sets it)
        b = self.ahead
        chunk = max(b, 4096 // b * b) if b else 4096  # a few thousand Python ints at a time, whole batches
        for k in range(0, len(mine), chunk):
            ids = mine[k:k + chunk + b].tolist()  # (and the batch after the chunk, to read it ahead)
            if not b:
                yield from ids
                continue
            for j in range(0, min(chunk, len(ids)), b):  # a batch at a time, the next one's windows asked for first
                self.dataset.will_need(ids[j + b:j + 2 * b])
                yield from ids[j:j + b]

    def __len__(self) -> int:
        return self.num_samples - self.start


class Batches:
    """An endless iterator over (inputs, targets) batches of this rank's share.

    ``set_epoch`` gives each pass over the data a new shuffle that every rank agrees on:
    forget it and every epoch repeats the first one's order. ``state_dict`` is the
    position (epoch, global batches consumed in it): the same on every rank and for any
    world size, so a resumed run continues with exactly the batch it would have seen.
    ``pin_memory``: each batch in pinned memory (``Run`` sets it, ``pins_for`` the run's device).
    ``wait_s``: the seconds the loop has spent waiting for batches so far (inside ``next``:
    sampling, reading the windows, stacking them, pinning), which ``Run`` reports per step.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, shuffle: bool = True):
        if global_batch_size % dp_size:
            raise UserError(f"--global-batch-size {global_batch_size} does not divide among {dp_size} "
                            f"data-parallel ranks; use a multiple of {dp_size}.")
        self.dataset = TokenWindows(tokens, seq_len)
        if len(self.dataset) < global_batch_size:
            raise UserError(f"the data holds {len(self.dataset)} sequences of {seq_len + 1} tokens, fewer than "
                            f"one global batch of {global_batch_size}; use more text, a shorter --seq-len "
                            f"or a smaller --global-batch-size.")
        self.sampler = WindowOrder(self.dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed,
                                   drop_last=True)
        self.sampler.ahead = global_batch_size // dp_size
        self.loader = DataLoader(self.dataset, batch_size=global_batch_size // dp_size,
                                 sampler=self.sampler, drop_last=True)
        self.epoch, self.position = 0, 0
        self.pin_memory = False
        self.wait_s = 0.0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict):
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def __iter__(self):
        # What runs between the caller's next() and the yield is the time the loop waits for a
        # batch: the loader works in this process, on demand, with no batch made ahead
        asked = time.perf_counter()
        while True:
            self.sampler.set_epoch(self.epoch)
            self.sampler.start = self.position * self.loader.batch_size  # resuming: skip, unread, what was trained on
            for batch in self.loader:
                self.position += 1
                if self.pin_memory:  # (rebound: the unpinned batch is not kept alive beside the pinned one)
                    batch = [t.pin_memory() for t in batch]
                self.wait_s += time.perf_counter() - asked
                yield batch
                asked = time.perf_counter()
            self.epoch, self.position = self.epoch + 1, 0
