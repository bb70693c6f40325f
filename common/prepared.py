"""A prepared data folder (``python -m tools.prepare_data``): tokens on disk, read in place.

The folder holds ``tokenizer.json`` (Hugging Face's format), the token shards of each split,
each split's document offsets and ``meta.json``, which lists every file with its hash. A
shard is a header of 256 little-endian uint32 (magic ``TOKS``, format version, bytes per
token, token count as two words, vocabulary size; the rest zero) then the tokens, uint16
where the vocabulary fits in 65,536 ids, else uint32: the idea of llm.c's ``.bin`` files,
in a format of our own. Every document starts with the end-of-text token, so the model
always sees where one ends and the next begins; ``<split>_offsets.npy`` holds where each
document starts in its split's token stream, then the stream's length.

Training never loads the tokens into memory: each split is a ``TokenStream`` over its
shards, memory-mapped (``mmap``, read through numpy), and a rank reads only the windows its sampler gives it,
so the process's own memory does not grow with the corpus (the pages it reads are the
operating system's file cache, mapped in and dropped again as memory is needed). A shard edited or replaced since it was prepared
is refused when opened (its size and header against meta.json: cheap at every start); its
full hash is compared by prepare and, through meta.json's hash, by --resume.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import mmap
from pathlib import Path

import numpy as np
import torch

from common.errors import UserError

MAGIC = int.from_bytes(b"TOKS", "little")  # reads "TOKS" in a hex dump of any shard
VERSION = 1
HEADER_WORDS = 256
HEADER_BYTES = HEADER_WORDS * 4
DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}  # header's bytes per token -> dtype
DTYPES_BY_NAME = {d.name: d for d in DTYPES.values()}  # meta.json's "dtype" -> dtype
EOT = "<|endoftext|>"
EOT_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>")  # what other tokenizers call the end of a text
META = "meta.json"


def dtype_for(vocab_size: int) -> np.dtype:
    """The smallest token dtype that holds every id below ``vocab_size``."""
    return DTYPES[2] if vocab_size <= 2**16 else DTYPES[4]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_shard(path: Path, tokens: np.ndarray, vocab_size: int, dtype: np.dtype | None = None) -> dict:
    """Write one shard (header, then ``tokens``); return its entry for meta.json."""
    dtype = np.dtype(dtype or dtype_for(vocab_size))
    if dtype not in DTYPES.values():
        raise ValueError(f"shards hold uint16 or uint32 tokens, not {dtype}")
    if vocab_size > np.iinfo(dtype).max + 1:
        raise ValueError(f"a vocabulary of {vocab_size} does not fit in {dtype.name}")
    header = np.zeros(HEADER_WORDS, dtype="<u4")
    header[:6] = [MAGIC, VERSION, dtype.itemsize, len(tokens) & 0xFFFFFFFF, len(tokens) >> 32, vocab_size]
    body = np.ascontiguousarray(tokens, dtype=dtype).tobytes()
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(body)
    return {"file": path.name, "tokens": int(len(tokens)), "bytes": HEADER_BYTES + len(body),
            "sha256": hashlib.sha256(header.tobytes() + body).hexdigest()}


def read_header(path: Path) -> dict:
    """The header's fields, or one sentence saying the file is not a shard."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError as e:
        raise UserError(f"--data: cannot read shard {path} ({e.strerror}); prepare the folder again "
                        f"(python -m tools.prepare_data).") from None
    header = np.frombuffer(raw, dtype="<u4") if len(raw) == HEADER_BYTES else None
    if header is None or header[0] != MAGIC or header[1] != VERSION or int(header[2]) not in DTYPES:
        raise UserError(f"--data: {path} is not a token shard of this tutorial (format version {VERSION}); "
                        f"prepare the folder again (python -m tools.prepare_data).")
    return {"itemsize": int(header[2]), "tokens": int(header[3]) | int(header[4]) << 32,
            "vocab_size": int(header[5])}


class TokenStream:
    """One split's shards end to end, memory-mapped: ``len()`` and slices, as a tensor of
    token ids would offer them to ``data.TokenWindows`` (a window may span two shards).

    ``will_need`` asks the operating system to start reading token ranges from the disk now
    (``madvise(MADV_WILLNEED)``: it returns at once, the kernel reads in the background), so
    that a batch's windows are in memory when the loop asks for them: the loader names the
    next batch's windows as it hands out this one (data.WindowOrder).
    """

    def __init__(self, shards: list[np.ndarray], maps: list | None = None):
        self.shards, self.maps = shards, maps or [None] * len(shards)  # each shard's mmap.mmap, or None
        self.starts = [0]
        for s in shards:
            self.starts.append(self.starts[-1] + len(s))

    def will_need(self, start: int, stop: int) -> None:
        """Read tokens [start, stop) ahead, where this OS can (Linux and macOS; elsewhere nothing)."""
        i = bisect.bisect_right(self.starts, start) - 1
        while start < stop and i < len(self.shards):
            end = min(stop, self.starts[i + 1])
            m, size = self.maps[i], self.shards[i].itemsize
            if m is not None and hasattr(m, "madvise"):
                first = HEADER_BYTES + (start - self.starts[i]) * size
                aligned = first - first % mmap.PAGESIZE  # (madvise takes whole pages)
                m.madvise(mmap.MADV_WILLNEED, aligned, HEADER_BYTES + (end - self.starts[i]) * size - aligned)
            start, i = end, i + 1

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, key) -> torch.Tensor:
        if isinstance(key, int):
            return self[key:key + 1][0] if key >= 0 else self[len(self) + key]
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("a TokenStream is sliced in order (step 1)")
        pieces = []
        i = bisect.bisect_right(self.starts, start) - 1
        while start < stop:  # copy out only the window: the rest stays on disk
            end = min(stop, self.starts[i + 1])
            pieces.append(self.shards[i][start - self.starts[i]:end - self.starts[i]])
            start, i = end, i + 1
        out = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        return torch.from_numpy(out.astype(np.int64))


def is_prepared(spec: str) -> bool:
    return spec not in ("stdlib", "synthetic") and (Path(spec) / META).is_file()


def looks_prepared(folder: Path) -> bool:
    """A folder with a tokenizer or shards but no meta.json: an unfinished or damaged prepare,
    which must not be read as a folder of text (its shards would train as bytes)."""
    return (folder / "tokenizer.json").is_file() or any(folder.glob("*_000000.bin"))


def read_meta(folder: Path) -> dict:
    """meta.json of a prepared folder, or one sentence."""
    try:
        meta = json.loads((folder / META).read_text())
        ok = (meta.get("format") == "tutorial-tokens" and meta["version"] == VERSION and "train" in meta["splits"]
              and meta["dtype"] in DTYPES_BY_NAME and isinstance(meta["vocab_size"], int)
              and isinstance(meta["tokenizer"]["sha256"], str))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError):
        ok = False
    if not ok:
        raise UserError(f"--data {folder}: {META} is not one that python -m tools.prepare_data writes (format "
                        f"version {VERSION}); prepare the folder again.")
    return meta


def identity(folder: Path) -> str:
    """The data's identity for a checkpoint: the hash of meta.json, which lists the hash of
    the tokenizer and of every shard, so another tokenizer or re-prepared text changes it."""
    return hashlib.sha256((Path(folder) / META).read_bytes()).hexdigest()[:16]


def open_split(folder: Path, meta: dict, split: str) -> TokenStream:
    shards, maps = [], []
    for entry in meta["splits"].get(split, {}).get("shards", []):
        path = folder / entry["file"]
        header = read_header(path)
        size = path.stat().st_size
        if (header["tokens"] != entry["tokens"] or size != entry["bytes"] or header["vocab_size"] != meta["vocab_size"]
                or header["itemsize"] != DTYPES_BY_NAME[meta["dtype"]].itemsize):
            raise UserError(f"--data: shard {path} has changed since it was prepared (its size or header is not "
                            f"what {META} records); prepare the folder again (python -m tools.prepare_data).")
        if not header["tokens"]:
            shards.append(np.zeros(0, np.uint16))
            maps.append(None)
            continue
        with open(path, "rb") as f:  # (the map outlives the file object)
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        shards.append(np.frombuffer(m, dtype=DTYPES[header["itemsize"]], count=header["tokens"], offset=HEADER_BYTES))
        maps.append(m)
    return TokenStream(shards, maps)


def open_splits(spec: str, vocab_size: int) -> tuple[TokenStream, TokenStream, list[str], list[str]]:
    """The prepared folder ``spec``'s train and val TokenStreams and their shards' names
    (data.load_corpus makes them its Corpus)."""
    folder = Path(spec)
    meta = read_meta(folder)
    if vocab_size != meta["vocab_size"]:  # cli.parse sets the model's from meta.json: a caller's mistake
        raise UserError(f"--vocab-size {vocab_size} disagrees with --data {spec}, whose tokenizer has "
                        f"{meta['vocab_size']} tokens; drop --vocab-size or give {meta['vocab_size']}.")
    tokenizer = folder / "tokenizer.json"
    if not tokenizer.is_file() or sha256_file(tokenizer) != meta["tokenizer"]["sha256"]:
        raise UserError(f"--data: {tokenizer} is missing or has changed since the folder was prepared; prepare "
                        f"the folder again (python -m tools.prepare_data).")
    train, val = open_split(folder, meta, "train"), open_split(folder, meta, "val")
    return (train, val, [e["file"] for e in meta["splits"]["train"]["shards"]],
            [e["file"] for e in meta["splits"].get("val", {}).get("shards", [])])


def vocab_of(spec: str, asked: int | None) -> tuple[int, str] | None:
    """For cli.parse: (the vocabulary, the data's identity) of a prepared ``--data``, checked
    against ``--vocab-size`` if given; None for any other --data."""
    if not is_prepared(spec):
        return None
    meta = read_meta(Path(spec))
    if asked is not None and asked != meta["vocab_size"]:
        raise UserError(f"--vocab-size {asked} disagrees with --data {spec}, whose tokenizer has "
                        f"{meta['vocab_size']} tokens; drop --vocab-size (the model takes the tokenizer's).")
    return meta["vocab_size"], identity(Path(spec))


def take_vocab(args) -> None:
    """``--data DIR`` of the estimator and the planner: the model takes the vocabulary of a
    prepared folder's tokenizer, as a training script does (checked against --vocab-size when
    both are given). They read nothing else of it."""
    if getattr(args, "data", None) is None:
        return
    found = vocab_of(args.data, args.vocab_size)
    if found is None:
        raise UserError(f"--data {args.data} is not a folder python -m tools.prepare_data wrote (no {META} there); "
                        f"give one, or --vocab-size alone.")
    args.vocab_size = found[0]


# ---- the tokenizer, for what uses a trained model (tools.generate, tools.export_hf) ----------
def vocab_size_of(tok) -> int:
    """A tokenizers.Tokenizer's vocabulary as the model sees it: its largest id + 1."""
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


def end_of_text(tok) -> str | None:
    return next((t for t in EOT_NAMES if tok.token_to_id(t) is not None), None)


def load_tokenizer(path) -> tuple:
    """(tokenizers.Tokenizer, its end-of-text token or None) of a prepared folder or a
    tokenizer.json; one sentence if there is none that loads."""
    from common.hf import require
    tokenizers = require("tokenizers")
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    try:
        tok = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # noqa: BLE001 (the tokenizers library raises a bare Exception for every reason)
        reason = "no such file" if not file.is_file() else (str(e).splitlines() or [type(e).__name__])[0][:120]
        raise UserError(f"--tokenizer {path}: not a prepared folder or a tokenizer.json that loads ({reason}).") \
            from None
    eot = read_meta(path)["tokenizer"]["eot"] if (path / META).is_file() else end_of_text(tok)
    return tok, eot
