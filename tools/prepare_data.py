"""Tokenize a corpus once, into shards that every training script's --data reads in place.

    python -m tools.prepare_data SRC --out DIR [--tokenizer bpe|bytes|PATH/tokenizer.json]
                                 [--vocab-size N] [--val-every K]
    torchrun --nproc-per-node 4 step3_multi_gpu/train_ddp.py --data DIR

SRC is a text file (one document), a folder of them (each file one document; a .jsonl file
inside counts as below), or a .jsonl file whose lines are JSON objects with a "text" field
(each line one document). Every document must be UTF-8 text.

--tokenizer bpe (the default) trains a byte-level BPE of --vocab-size tokens (default 8192)
with Hugging Face's tokenizers on the training documents: any UTF-8 text encodes and decodes
back exactly, since the 256 bytes are in its vocabulary. --tokenizer bytes keeps the training
scripts' byte vocabulary, token id = byte value, and adds an end-of-text token (id 256: 257
tokens). A path loads any tokenizer.json; it keeps its own end-of-text token ("<|endoftext|>",
"<|end_of_text|>", "</s>" or "<eos>", the first found), or gets "<|endoftext|>" added.

DIR gets tokenizer.json, the token shards of the train and val splits (common/prepared.py
has the format), each split's document offsets and meta.json (the hashes of the source, the
tokenizer and every file). One document in K, by a hash of its name, is held out for
validation (a lone document: its last 1/K, cut at a line). Every document starts with the
end-of-text token; its text inside a document is text, never a boundary. Everything is
written into a temporary folder first and renamed to DIR at the end: an error or a Ctrl-C
leaves DIR as it was. The same inputs give byte-identical files, and a rerun that finds DIR
up to date (the same source and settings, every file's hash as meta.json says) leaves it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import zlib
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file: find common/

import numpy as np

from common import prepared
from common.data import VAL_EVERY
from common.errors import UserError, main_guard

DEFAULT_VOCAB = 8192
SHARD_TOKENS = 100_000_000  # llm.c's size: 200 MB of uint16 a shard
ENCODE_BATCH = 1 << 20  # characters handed to the tokenizer at once (it encodes a batch on every core)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.prepare_data", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="a text file, a folder of text files, or a .jsonl file with a \"text\" field a line")
    p.add_argument("--out", required=True, help="the prepared folder to write (replaced as a whole)")
    p.add_argument("--tokenizer", default="bpe", help="bpe (default), bytes, or a path to a tokenizer.json")
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"--tokenizer bpe's vocabulary, the end-of-text token included (default: {DEFAULT_VOCAB})")
    p.add_argument("--val-every", type=int, default=VAL_EVERY,
                   help=f"hold out one document in K for validation (default: {VAL_EVERY}; 0: none)")
    p.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS, help=f"tokens a shard (default: {SHARD_TOKENS:,})")
    p.add_argument("--dtype", default="auto", choices=("auto", "uint16", "uint32"),
                   help="the tokens' type on disk (default: auto, uint16 where the vocabulary fits, else uint32)")
    return p


def bar(total: int, what: str, unit: str):
    """A progress bar on a terminal; none in a log file or a test's captured output."""
    from tqdm import tqdm
    return tqdm(total=total, desc=what, unit=unit, unit_scale=unit != "doc", dynamic_ncols=True, disable=None)


# ---- the source: documents, read the same way in every pass --------------------------------
def source_files(src: Path, out: Path | None = None) -> tuple[Path, list[Path]]:
    """(the folder names are relative to, the files in order); hidden ones and --out left out."""
    if not src.exists():
        raise UserError(f"{src}: no such file or folder; give a text file, a folder of them or a .jsonl file.")
    if src.is_file():
        return src.parent, [src]
    skip = out.resolve() if out else None  # (a prepared folder inside the source is not text)
    files = [p for p in src.rglob("*") if p.is_file() and not any(s.startswith(".") for s in p.relative_to(src).parts)
             and not (skip and p.resolve().is_relative_to(skip))]
    return src, sorted(files, key=lambda p: p.relative_to(src).as_posix())


def _utf8(raw: bytes, where: str, whole_file: bool) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        where = f"{where}, line {line}," if whole_file else where
        raise UserError(f"{where} is not UTF-8 text (byte {e.start} of the {'file' if whole_file else 'line'}); "
                        f"convert it to UTF-8 or leave it out.") from None


def documents(root: Path, files: list[Path]):
    """(name, text) of every document in order: a file, or a line of a .jsonl file."""
    for path in files:
        rel = path.relative_to(root).as_posix()
        try:
            if path.suffix != ".jsonl":
                yield rel, _utf8(path.read_bytes(), str(path), whole_file=True)
                continue
            with open(path, "rb") as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    where = f"{path}:{number}"
                    try:
                        text = json.loads(_utf8(line, where, whole_file=False)).get("text")
                    except (json.JSONDecodeError, AttributeError):
                        text = None
                    if not isinstance(text, str):
                        raise UserError(f"{where} is not a JSON object with a \"text\" string; a .jsonl source "
                                        f"holds one such object a line.")
                    yield f"{rel}:{number}", text
        except OSError as e:
            raise UserError(f"{path} cannot be read ({e.strerror}).") from None


class Source:
    """The source, scanned once: its hash and which documents are held out, decided by name."""

    def __init__(self, src: Path, val_every: int, out: Path | None = None):
        self.root, self.files = source_files(src, out)
        self.val_every = val_every
        h, held_out, chars = hashlib.sha256(), bytearray(), 0
        with bar(sum(p.stat().st_size for p in self.files), "read", unit="B") as progress:
            for name, text in documents(self.root, self.files):
                try:
                    raw = text.encode()
                except UnicodeEncodeError:  # JSON can spell a lone surrogate ("\ud800"), which no text holds
                    raise UserError(f"{name} in {src} is not valid Unicode text (a lone surrogate); fix it or leave "
                                    f"it out.") from None
                progress.update(len(raw))
                if not text:
                    continue  # an empty document is nothing to learn from
                h.update(f"{name}\0{len(raw)}\0".encode() + raw)
                held_out.append(bool(val_every) and zlib.crc32(name.encode()) % val_every == 0)
                chars += len(text)
        if not held_out:
            raise UserError(f"{src} holds no text (no file, or only empty ones); give text to prepare.")
        if val_every and len(held_out) > 1 and not any(held_out):
            held_out[-1] = True  # a few documents whose names all missed: hold out the last
        self.sha256, self.held_out, self.chars = h.hexdigest(), held_out, chars

    def __len__(self):
        return len(self.held_out)

    def split(self):
        """(text, held out?) of every non-empty document; a lone one gives its tail to validation."""
        texts = (text for _, text in documents(self.root, self.files) if text)
        if len(self) == 1 and self.val_every:
            text = next(texts)
            at = int(len(text) * (1 - 1 / self.val_every))
            cut = text.rfind("\n", 0, at) + 1 or at  # at a line break where there is one
            yield text[:cut], False
            yield text[cut:], True
            return
        yield from zip(texts, map(bool, self.held_out))


# ---- the tokenizer -----------------------------------------------------------------------
def make_tokenizer(args, source: Source):
    """(the tokenizers.Tokenizer, the end-of-text token, kind)."""
    from common.hf import bytes_tokenizer, require
    require("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if args.tokenizer == "bytes":
        return bytes_tokenizer(eot=prepared.EOT), prepared.EOT, "bytes"
    if args.tokenizer != "bpe":
        try:
            tok = Tokenizer.from_file(args.tokenizer)
        except Exception as e:  # noqa: BLE001 (tokenizers raises its own Exception for every reason)
            raise UserError(f"--tokenizer {args.tokenizer} is not a tokenizer.json that the tokenizers library "
                            f"loads ({(str(e).splitlines() or [type(e).__name__])[0][:120]}).") from None
        eot = prepared.end_of_text(tok)
        if eot is None:
            eot = prepared.EOT
            tok.add_special_tokens([eot])
            print(f"{args.tokenizer} has no end-of-text token: added {eot} as id {tok.token_to_id(eot)}", flush=True)
        return tok, eot, "file"
    tok = Tokenizer(models.BPE())
    # Byte-level: the text's bytes, each as one printable character, are the starting alphabet,
    # so no text is ever unknown; the regex splits words, numbers and spaces apart first (GPT-2's).
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=[prepared.EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    train = [i for i, held in enumerate(source.held_out) if not held]
    with bar(len(train) if len(source) > 1 else 1, "train BPE", unit="doc") as progress:
        texts = (progress.update(1) or text for text, held in source.split() if not held)
        tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() < args.vocab_size:
        print(f"the text has too few distinct pieces for {args.vocab_size} tokens: the tokenizer has "
              f"{tok.get_vocab_size()}", flush=True)
    return tok, prepared.EOT, "bpe"


# ---- the shards --------------------------------------------------------------------------
class SplitWriter:
    """One split's token stream, cut into shards of ``shard_tokens``, and its documents' starts."""

    def __init__(self, folder: Path, split: str, vocab_size: int, dtype: np.dtype, shard_tokens: int):
        self.folder, self.split, self.vocab_size, self.dtype = folder, split, vocab_size, dtype
        self.buffer, self.filled = np.empty(shard_tokens, dtype=dtype), 0
        self.shards, self.offsets, self.total = [], [], 0

    def add(self, ids: np.ndarray):
        self.offsets.append(self.total)
        self.total += len(ids)
        while len(ids):
            n = min(len(ids), len(self.buffer) - self.filled)
            self.buffer[self.filled:self.filled + n] = ids[:n]
            self.filled, ids = self.filled + n, ids[n:]
            if self.filled == len(self.buffer):
                self._flush()

    def _flush(self):
        path = self.folder / f"{self.split}_{len(self.shards):06d}.bin"
        self.shards.append(prepared.write_shard(path, self.buffer[:self.filled], self.vocab_size, self.dtype))
        self.filled = 0

    def close(self) -> dict:
        if self.filled:
            self._flush()
        offsets = self.folder / f"{self.split}_offsets.npy"
        np.save(offsets, np.array([*self.offsets, self.total], dtype=np.int64))
        return {"tokens": self.total, "documents": len(self.offsets),
                "offsets": {"file": offsets.name, "sha256": prepared.sha256_file(offsets)}, "shards": self.shards}


def encoded(tok, kind: str, eot_id: int, docs):
    """(ids with the end-of-text token first, held out?, characters) of each document, in batches."""
    tok.encode_special_tokens = True  # "<|endoftext|>" inside a text is text, not a boundary
    batch, size = [], 0
    for text, held in docs:
        batch.append((text, held))
        size += len(text)
        if size >= ENCODE_BATCH:
            yield from _encode_batch(tok, kind, eot_id, batch)
            batch, size = [], 0
    yield from _encode_batch(tok, kind, eot_id, batch)


def _encode_batch(tok, kind, eot_id, batch):
    if kind == "bytes":  # the byte tokenizer's ids are the bytes: no need to ask it
        ids = [np.frombuffer(text.encode(), dtype=np.uint8) for text, _ in batch]
    else:
        ids = [np.asarray(e.ids, dtype=np.int64) for e in
               tok.encode_batch([text for text, _ in batch], add_special_tokens=False)]
    for (text, held), one in zip(batch, ids):
        yield np.concatenate([[eot_id], one]), held, len(text)


# ---- the whole job -----------------------------------------------------------------------
def check(args):
    if args.val_every < 0 or args.val_every == 1:
        raise UserError(f"--val-every must be 0 (no validation) or 2 or more (got {args.val_every}: "
                        f"{'every document' if args.val_every == 1 else 'no meaning'} held out).")
    if args.shard_tokens < 1:
        raise UserError(f"--shard-tokens must be positive (got {args.shard_tokens}).")
    if args.tokenizer != "bpe" and args.vocab_size is not None:
        raise UserError(f"--vocab-size is --tokenizer bpe's; --tokenizer {args.tokenizer} has a vocabulary of its own: "
                        f"drop --vocab-size.")
    if args.tokenizer not in ("bpe", "bytes") and not Path(args.tokenizer).is_file():
        raise UserError(f"--tokenizer {args.tokenizer}: no such file; give bpe, bytes or the path of a tokenizer.json.")
    if args.tokenizer == "bpe":
        args.vocab_size = DEFAULT_VOCAB if args.vocab_size is None else args.vocab_size
        check_vocab(args.vocab_size, args.dtype, "--vocab-size")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / prepared.META).is_file())):
        raise UserError(f"--out {out} exists and is not a prepared data folder; give a new or empty folder "
                        f"(a prepared one is replaced).")


def check_vocab(n: int, dtype: str, what: str, least: int = 257):
    if n < least:
        why = "a byte-level BPE needs the 256 bytes and the end-of-text token" if least == 257 else "too few to learn"
        raise UserError(f"{what} {n} is too small: {why}; give {least} or more.")
    limit = 2**16 if dtype == "uint16" else 2**31 - 1  # the model's embedding is indexed with int32 at most
    if n > limit:
        fix = "use --dtype uint32 (or auto)" if dtype == "uint16" else "use a smaller vocabulary"
        raise UserError(f"{what} {n:,} is too large for {dtype if dtype == 'uint16' else 'the model'} "
                        f"(at most {limit:,} token ids); {fix}.")


def settings(args) -> dict:
    """What the files depend on besides the source (a rerun with the same is up to date)."""
    tokenizer = args.tokenizer if args.tokenizer in ("bpe", "bytes") else \
        f"file sha256 {prepared.sha256_file(Path(args.tokenizer))}"  # (check() made sure it is a file)
    return {"tokenizer": tokenizer, "vocab_size": args.vocab_size, "val_every": args.val_every,
            "shard_tokens": args.shard_tokens, "dtype": args.dtype, "version": prepared.VERSION}


def up_to_date(out: Path, source: Source, wanted: dict) -> bool:
    try:
        meta = json.loads((out / prepared.META).read_text())
        if meta.get("settings") != wanted or meta["source"]["sha256"] != source.sha256:
            return False
        files = {"tokenizer.json": meta["tokenizer"]["sha256"]}
        for split in meta["splits"].values():
            files[split["offsets"]["file"]] = split["offsets"]["sha256"]
            files |= {s["file"]: s["sha256"] for s in split["shards"]}
        return all(prepared.sha256_file(out / f) == h for f, h in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def prepare(args) -> Path:
    check(args)
    out, wanted = Path(args.out), settings(args)
    source = Source(Path(args.src), args.val_every, out)
    if up_to_date(out, source, wanted):
        print(f"{out} is up to date (the same source and settings, every file as meta.json records it)", flush=True)
        return out
    tok, eot, kind = make_tokenizer(args, source)
    vocab_size, eot_id = prepared.vocab_size_of(tok), tok.token_to_id(eot)
    # (a loaded tokenizer may be smaller than the bytes: a character-level one, say)
    check_vocab(vocab_size, args.dtype, f"--tokenizer {args.tokenizer}'s vocabulary of", 257 if kind == "bpe" else 2)
    dtype = prepared.dtype_for(vocab_size) if args.dtype == "auto" else prepared.DTYPES_BY_NAME[args.dtype]
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    made = [p for p in [out.parent, *out.parent.parents] if not p.exists()]  # deepest first
    try:
        partial.mkdir(parents=True)
    except OSError as e:
        raise UserError(f"--out {out} cannot be written ({e.strerror}); give a folder you can write to.") from None
    old, done = out.parent / f".{out.name}.old-{os.getpid()}", False
    try:
        tok.save(str(partial / "tokenizer.json"))
        writers = {s: SplitWriter(partial, s, vocab_size, dtype, args.shard_tokens) for s in ("train", "val")}
        with bar(source.chars, "tokenize", unit="char") as progress:
            for ids, held, chars in encoded(tok, kind, eot_id, source.split()):
                writers["val" if held else "train"].add(ids)
                progress.update(chars)
        splits = {s: w.close() for s, w in writers.items()}
        meta = {"format": "tutorial-tokens", "version": prepared.VERSION,
                "source": {"name": Path(args.src).name, "sha256": source.sha256, "documents": len(source)},
                "tokenizer": {"kind": kind, "file": "tokenizer.json", "eot": eot, "eot_id": eot_id,
                              "sha256": prepared.sha256_file(partial / "tokenizer.json")},
                "vocab_size": vocab_size, "dtype": dtype.name, "settings": wanted, "splits": splits}
        (partial / prepared.META).write_text(json.dumps(meta, indent=1) + "\n")
        if out.exists():
            out.rename(old)  # (a folder cannot be renamed over a non-empty one in one step)
        partial.rename(out)
        shutil.rmtree(old, ignore_errors=True)
        done = True
    finally:
        if not done:  # an error or a Ctrl-C: nothing of this run stays, and DIR is what it was
            shutil.rmtree(partial, ignore_errors=True)
            if old.exists() and not out.exists():
                old.rename(out)
            for folder in made:
                try:
                    folder.rmdir()
                except OSError:
                    pass
    t, v = splits["train"], splits["val"]
    print(f"wrote {out}: {t['tokens']:,} training tokens ({t['documents']:,} documents, {len(t['shards'])} shards), "
          f"{v['tokens']:,} validation tokens ({v['documents']:,} documents), a vocabulary of {vocab_size:,} "
          f"({dtype.name}); train with --data {out}", flush=True)
    return out


@main_guard
def main(argv=None):
    prepare(parser().parse_args(argv))


if __name__ == "__main__":
    main()
