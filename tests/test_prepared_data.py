"""Real data at scale: ``python -m tools.prepare_data`` tokenizes once, every script trains
on the memory-mapped shards (tools/prepare_data.py, common/prepared.py).

A tiny corpus written here (a dozen files of the standard library's source, a file of
non-ASCII text, a .jsonl file), a BPE of 300 tokens, shards of 4,000 tokens so that a
window spans two of them. Prepare runs in this process (a second or two); the training
runs are DDP on 2 ranks with checkpoints beside the same script as one process and every
other step-3 layout on 2 ranks (two torchrun jobs of tools/multirun.py), then a 1-process run
resumed from the 2-rank checkpoint. tools.generate and
tools.export_hf then speak the tokenizer of the 1-process run's data.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from common import cli, prepared
from common.checkpoint_meta import config_differences, read_meta
from common.data import Batches, load_corpus
from common.errors import UserError
from common.hf import byte_chars
import launch
from conftest import ROOT, hang_limit
from tests.tolerances import PARITY_RTOL
from tools import prepare_data

TIMEOUT_S = hang_limit(300)  # a hang detector: the three launches take about a minute on an idle 2-core machine
UNICODE = "héllo wörld, naïve café, 日本語のテキスト, emoji 🎉, and <|endoftext|> as mere text\n"
VOCAB = 300
FLAGS = ["--model", "debug", "--steps", "4", "--seq-len", "32", "--global-batch-size", "4", "--amp", "off",
         "--device", "cpu", "--no-trace-memory", "--eval-batches", "1"]


def _prepare(src, out, *flags) -> Path:
    prepare_data.prepare(prepare_data.parser().parse_args([str(src), "--out", str(out), *flags]))
    return Path(out)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    from common.data import stdlib_root
    folder = tmp_path_factory.mktemp("corpus") / "src"
    folder.mkdir()
    for p in sorted(stdlib_root().glob("*.py"))[:12]:
        (folder / p.name).write_text(p.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    (folder / "unicode.txt").write_text(UNICODE * 20, encoding="utf-8")
    (folder / "notes.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in
                                                enumerate(["first note\n", "", UNICODE, "def f():\n    pass\n"])))
    return folder


@pytest.fixture(scope="module")
def bpe(src) -> Path:
    return _prepare(src, src.parent / "bpe", "--vocab-size", str(VOCAB), "--shard-tokens", "4000", "--val-every", "4")


# ---- prepare ------------------------------------------------------------------------------
def test_prepare_is_deterministic_and_a_rerun_leaves_an_up_to_date_folder(src, bpe, tmp_path, capsys):
    src = shutil.copytree(src, tmp_path / "src")  # (the same name: meta.json names the source)
    again = _prepare(src, tmp_path / "again", "--vocab-size", str(VOCAB), "--shard-tokens", "4000", "--val-every", "4")
    assert _files(again) == _files(bpe)  # byte for byte: tokenizer, shards, offsets, meta.json
    assert len([f for f in _files(bpe) if f.startswith("train_0")]) > 2
    stamps = {p.name: p.stat().st_mtime_ns for p in again.iterdir()}
    capsys.readouterr()
    _prepare(src, again, "--vocab-size", str(VOCAB), "--shard-tokens", "4000", "--val-every", "4")
    assert "is up to date" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in again.iterdir()} == stamps  # nothing rewritten
    # another setting is another folder, replaced whole; a changed file is written again
    _prepare(src, again, "--vocab-size", str(VOCAB), "--val-every", "4")
    assert not (again / "train_000001.bin").exists() and not list(tmp_path.glob(".again.*"))
    capsys.readouterr()
    (src / "unicode.txt").write_text(UNICODE * 21, encoding="utf-8")
    _prepare(src, again, "--vocab-size", str(VOCAB), "--val-every", "4")
    assert "is up to date" not in capsys.readouterr().out
    # a prepared folder inside its source is not read as text the next time
    _prepare(src, src / "prepared", "--tokenizer", "bytes")
    _prepare(src, src / "prepared", "--tokenizer", "bytes")
    assert "is up to date" in capsys.readouterr().out


def test_the_bpe_tokenizer_is_lossless_and_loads_in_transformers(bpe):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer.from_file(str(bpe / "tokenizer.json"))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(bpe / "tokenizer.json"))
    assert tok.get_vocab_size() == VOCAB and tok.token_to_id(prepared.EOT) == 0
    for text in (UNICODE.replace(prepared.EOT, ""), "  two spaces,\ttab\r\nCRLF  \n\n", "ünïcödé 🎉🎉 Ωμέγα ∑ 𝔘",
                 "x" * 3 + " " * 5):
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text, text
        assert hf.encode(text, add_special_tokens=False) == ids, text
        assert hf.decode(ids) == text
    # The end-of-text token's text: a boundary to a plain encode, which decode drops unless told to
    # keep special tokens; as prepare encodes (encode_special_tokens), it is text like any other.
    assert tok.decode(tok.encode(UNICODE).ids, skip_special_tokens=False) == UNICODE
    tok.encode_special_tokens = True
    assert 0 not in tok.encode(UNICODE).ids and tok.decode(tok.encode(UNICODE).ids) == UNICODE
    assert len(tok.encode("def __init__(self):").ids) < len("def __init__(self):")  # it learned merges


def test_the_shards_hold_every_document_after_its_end_of_text_token(src, bpe):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(bpe / "tokenizer.json"))
    meta = json.loads((bpe / "meta.json").read_text())
    assert meta["vocab_size"] == VOCAB and meta["dtype"] == "uint16" and meta["tokenizer"]["eot_id"] == 0
    shard = bpe / meta["splits"]["train"]["shards"][0]["file"]
    header = np.frombuffer(shard.read_bytes()[:prepared.HEADER_BYTES], dtype="<u4")
    assert shard.read_bytes()[:4] == b"TOKS" and list(header[1:6]) == [1, 2, 4000, 0, VOCAB] and not header[6:].any()
    assert shard.stat().st_size == prepared.HEADER_BYTES + 2 * 4000
    corpus = load_corpus(str(bpe), vocab_size=VOCAB)
    docs = list(prepare_data.Source(src, 4).split())
    for split, stream in (("train", corpus.train), ("val", corpus.val)):
        offsets = np.load(bpe / f"{split}_offsets.npy")
        texts = [t for t, held in docs if held == (split == "val")]
        assert len(offsets) == len(texts) + 1 and offsets[-1] == len(stream) == meta["splits"][split]["tokens"]
        tokens = stream[0:len(stream)]
        assert (tokens == 0).sum() == len(texts)  # "<|endoftext|>" inside a text is text
        for i, text in enumerate(texts):  # the documents, whole, in order, decoded exactly
            assert tokens[offsets[i]] == 0
            assert tok.decode(tokens[offsets[i] + 1:offsets[i + 1]].tolist()) == text
    assert any(held for _, held in docs) and "" not in [t for t, _ in docs]


def test_wide_vocabularies_take_uint32_shards(src, tmp_path):
    raw = _prepare(src, tmp_path / "bytes", "--tokenizer", "bytes", "--dtype", "uint32")
    meta = json.loads((raw / "meta.json").read_text())
    assert (meta["vocab_size"], meta["dtype"], meta["tokenizer"]["eot_id"]) == (257, "uint32", 256)
    assert prepared.read_header(raw / "train_000000.bin")["itemsize"] == 4
    train = load_corpus(str(raw), vocab_size=257).train
    first = sorted(src.iterdir())[0].read_bytes()  # token id = byte value, after the end-of-text id
    assert train[0:len(first) + 1].tolist() == [256, *first]
    # a tokenizer.json of 70,001 tokens (the byte alphabet, unused fillers, end of text at 70,000)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {c: b for b, c in enumerate(byte_chars())} | {f"<unused{i}>": i for i in range(256, 70_000)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([prepared.EOT])
    tok.save(str(tmp_path / "wide.json"))
    wide = _prepare(src, tmp_path / "wide", "--tokenizer", str(tmp_path / "wide.json"))
    assert json.loads((wide / "meta.json").read_text())["dtype"] == "uint32"
    assert load_corpus(str(wide), vocab_size=70_001).train[0:1].tolist() == [70_000]
    assert prepared.dtype_for(2**16) == np.uint16 and prepared.dtype_for(2**16 + 1) == np.uint32
    with pytest.raises(ValueError, match="does not fit in uint16"):
        prepared.write_shard(tmp_path / "x.bin", np.zeros(3, np.int64), 70_001, np.uint16)


# ---- the loader ---------------------------------------------------------------------------
def test_every_world_size_sees_the_same_global_batches_from_the_shards(bpe):
    train = load_corpus(str(bpe), vocab_size=VOCAB).train
    assert isinstance(train, prepared.TokenStream) and len(train.shards) > 2
    whole = np.concatenate([np.asarray(s) for s in train.shards]).astype(np.int64)
    assert train[3990:4010].tolist() == whole[3990:4010].tolist()  # a window across two shards
    assert len(train[len(train):]) == 0 and int(train[-1]) == whole[-1]

    def rows(world):
        its = [iter(Batches(train, 32, 8, dp_rank=r, dp_size=world, seed=3)) for r in range(world)]
        return [sorted(tuple(x.tolist()) for it in its for x in next(it)[0]) for _ in range(5)]
    reference = rows(1)
    assert all(rows(w) == reference for w in (2, 4))
    x, y = next(iter(Batches(train, 32, 8, seed=3)))
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < VOCAB


def test_the_loader_asks_the_disk_for_the_next_batch_while_this_one_trains(bpe):
    """Each batch handed out first names the next batch's windows to the OS (madvise
    WILLNEED on page-aligned ranges of the shards' maps), so a cold disk reads them while the
    step computes; at a world size of 2, each rank only its own. Recorded here on stand-ins
    of the maps, with the shards' real offsets."""
    import mmap
    calls = []

    class Map:  # records what would be asked of the kernel
        def __init__(self, shard):
            self.shard = shard

        def madvise(self, option, start, length):
            calls.append((self.shard, option, start, length))

    for world in (1, 2):
        train = load_corpus(str(bpe), vocab_size=VOCAB).train
        train.maps = [Map(i) for i in range(len(train.shards))]
        data = Batches(train, 32, 8, dp_rank=world - 1, dp_size=world, seed=3)
        order = list(data.sampler)  # this rank's windows, in order
        per = 8 // world
        it = iter(data)
        for k in range(2):
            calls.clear()
            next(it)
            asked = set()
            for shard, option, start, length in calls:
                assert option == mmap.MADV_WILLNEED and start % mmap.PAGESIZE == 0
                lo = train.starts[shard] + (start - prepared.HEADER_BYTES) // 2  # uint16 tokens
                hi = train.starts[shard] + (start + length - prepared.HEADER_BYTES) // 2
                asked |= set(range(max(lo, 0), hi))
            for w in order[(k + 1) * per:(k + 2) * per]:  # the next batch's windows, every token of them
                assert set(range(w * 32, (w + 1) * 32 + 1)) <= asked, (world, k, w)
            assert len(calls) <= 2 * per  # (a window across two shards: two calls)


def _parse(data, out, *flags):
    """Step 3's flags as train_ddp.py parses them, in this process."""
    p = cli.parser(None)
    cli.add_saver_flags(p)
    return cli.parse(p, [*FLAGS, "--data", str(data), "--out", str(out), *flags])


def test_the_model_takes_the_tokenizers_vocabulary(bpe, tmp_path):
    def parse(*flags):
        return _parse(bpe, tmp_path / "out", *flags)
    args = parse()
    assert args.model_config.vocab_size == VOCAB and args.data_id == prepared.identity(bpe)
    assert parse("--vocab-size", str(VOCAB)).model_config.vocab_size == VOCAB
    with pytest.raises(UserError, match=f"--vocab-size 256 disagrees with --data {bpe}, whose tokenizer has 300 "
                                        f"tokens; drop --vocab-size"):
        parse("--vocab-size", "256")


# ---- training on it: DDP on 2 ranks = 1 process; 2 ranks' checkpoint resumed on 1 --------------
DDP = str(ROOT / "step3_multi_gpu" / "train_ddp.py")


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


# Every other step-3 layout on 2 ranks, on the same data as the 1-process run ("one"). Two
# launches: runs of one job must not build an equal sub-mesh in another order (tools/multirun.py).
LAYOUTS = {"fsdp": ("train_fsdp",), "tp": ("train_tp", "--sequence-parallel"),
           "pp": ("train_pp", "--schedule", "1f1b", "--microbatches", "2"), "cp": ("train_cp",),
           "ep": ("train_ep", "--model", "debug-moe"),
           "2d": ("train_2d", "--tp", "2"), "3d": ("train_3d", "--pp", "2", "--dp", "1", "--tp", "1",
                                                   "--schedule", "gpipe", "--microbatches", "2")}
LAYOUT_JOBS = [("fsdp", "tp", "pp", "cp", "ep"), ("2d", "3d")]


@pytest.fixture(scope="module")
def runs(bpe):
    tmp = bpe.parent / "runs"
    data = tmp / "data"  # a copy the tests may re-prepare in place, leaving `bpe` to the others
    shutil.copytree(bpe, data)
    kw = dict(cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    two = launch.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        DDP, *FLAGS, "--data", str(data), "--ckpt-every", "2", "--out", str(tmp / "two")], **kw)
    # one process: DDP at world size 1, and the mixture of experts' reference for EP
    one = launch.Popen([sys.executable, "tools/multirun.py", "--runs", json.dumps([
        {"name": "one", "script": "step3_multi_gpu/train_ddp.py", "argv": [*FLAGS, "--data", str(bpe), "--save-weights",
                                                                       "--out", str(tmp / "one")]},
        {"name": "ep_one", "script": "step3_multi_gpu/train_ep.py", "argv": [*FLAGS, "--model", "debug-moe", "--data",
                                                                         str(bpe), "--out", str(tmp / "ep_one")]}])],
        **kw)
    layouts = {n: launch.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                "2", "tools/multirun.py", "--runs", json.dumps(
                                    [{"name": name, "script": f"step3_multi_gpu/{script}.py", "argv": [
                                        *FLAGS, *flags, "--data", str(bpe), "--out", str(tmp / name)]}
                                     for name, (script, *flags) in LAYOUTS.items() if name in job])], **kw)
               for n, job in enumerate(LAYOUT_JOBS)}
    for p in (two, one, *layouts.values()):
        out, err = p.communicate(timeout=TIMEOUT_S)
        assert p.returncode == 0, err[-3000:]
    (tmp / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp / "two" / "checkpoints" / "step_00000001", tmp / "resumed" / "checkpoints" / "step_00000001")
    r = launch.run([sys.executable, DDP, *FLAGS, "--data", str(data), "--resume", "--out", str(tmp / "resumed")],
                   timeout=TIMEOUT_S, **kw)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "saved by 2 rank(s)" in r.stdout
    return tmp


def test_two_ranks_on_prepared_data_match_one_process(runs):
    two, one = _losses(runs / "two"), _losses(runs / "one")
    assert list(two) == [0, 1, 2, 3]
    assert two == pytest.approx(one, rel=PARITY_RTOL)
    assert two[0] == pytest.approx(np.log(VOCAB), rel=0.05)  # an untrained model of 300 tokens
    summaries = [json.loads((runs / r / "summary.json").read_text()) for r in ("two", "one")]
    assert summaries[0]["world_size"] == 2 and summaries[0]["model_config"]["vocab_size"] == VOCAB
    assert summaries[0]["val_loss"] == pytest.approx(summaries[1]["val_loss"], rel=PARITY_RTOL)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_step3_layout_trains_on_prepared_data_as_one_process_does(runs, layout):
    """FSDP, TP with SP, a 1F1B pipeline, CP, 2-D and 3-D on 2 ranks give the 1-process run's
    losses and held-out loss on the BPE's shards (300 tokens: the output layer split in two
    under TP); EP on 2 ranks gives the mixture of experts' losses of EP in one process."""
    ref = "ep_one" if layout == "ep" else "one"
    got, want = _losses(runs / layout), _losses(runs / ref)
    assert list(got) == [0, 1, 2, 3] and got == pytest.approx(want, rel=PARITY_RTOL), (layout, got, want)
    summary, reference = (json.loads((runs / r / "summary.json").read_text()) for r in (layout, ref))
    assert summary["world_size"] == 2 and summary["model_config"]["vocab_size"] == VOCAB
    assert summary["val_loss"] == pytest.approx(reference["val_loss"], rel=PARITY_RTOL)


def test_a_two_rank_checkpoint_resumes_on_one_rank_at_the_uninterrupted_loss(runs):
    resumed, two = _losses(runs / "resumed"), _losses(runs / "two")
    assert list(resumed) == [2, 3]
    assert resumed == pytest.approx({s: two[s] for s in (2, 3)}, rel=PARITY_RTOL)


def test_resume_refuses_data_that_changed_under_the_same_path(runs, src, tmp_path):
    meta = read_meta(runs / "two" / "checkpoints" / "step_00000003")
    data = runs / "data"
    assert meta["data_id"] == prepared.identity(data)

    def args():
        return _parse(data, tmp_path / "out")
    assert config_differences(meta, args()) == []
    _prepare(src, data, "--vocab-size", str(VOCAB), "--shard-tokens", "4000", "--val-every", "3")  # re-split
    diff = config_differences(meta, args())
    assert len(diff) == 1 and diff[0].startswith(f"--data's contents (prepared folder's meta.json hash) "
                                                 f"{meta['data_id']} there, ")


# ---- bad input: one sentence, exit 2, nothing written ------------------------------------------
def _refused(capsys, tmp_path, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        prepare_data.main([*argv, "--out", str(tmp_path / "new" / "out")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert not (tmp_path / "new").exists()  # not even the folder above --out
    return err[len("error: "):]


def test_bad_sources_are_one_sentence_and_write_nothing(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    (tmp_path / "latin1").mkdir()
    (tmp_path / "latin1" / "a.txt").write_text("fine\n")
    (tmp_path / "latin1" / "b.txt").write_bytes(b"line one\ncaf\xe9\n")
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    (tmp_path / "notext.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    (tmp_path / "surrogate.jsonl").write_text('{"text": "half an emoji: \\ud83c"}\n')
    cases = {
        (str(tmp_path / "nope"),): f"{tmp_path / 'nope'}: no such file or folder",
        (str(tmp_path / "empty"),): "holds no text",
        (str(tmp_path / "latin1"),):
            f"{tmp_path / 'latin1' / 'b.txt'}, line 2, is not UTF-8 text (byte 12 of the file)",
        (str(tmp_path / "bad.jsonl"),): f"{tmp_path / 'bad.jsonl'}:2 is not UTF-8 text",
        (str(tmp_path / "notext.jsonl"),): f"{tmp_path / 'notext.jsonl'}:2 is not a JSON object with a \"text\" string",
        (str(tmp_path / "surrogate.jsonl"),): f"surrogate.jsonl:1 in {tmp_path / 'surrogate.jsonl'} is not valid "
                                              f"Unicode text (a lone surrogate)",
        (str(tmp_path / "bad.jsonl"), "--vocab-size", "256"): "--vocab-size 256 is too small: a byte-level BPE needs "
                                                             "the 256 bytes and the end-of-text token; give 257",
        (str(tmp_path / "bad.jsonl"), "--vocab-size", "70000", "--dtype", "uint16"):
            "--vocab-size 70,000 is too large for uint16 (at most 65,536 token ids); use --dtype uint32",
        (str(tmp_path / "bad.jsonl"), "--tokenizer", "bytes", "--vocab-size", "512"): "drop --vocab-size",
        (str(tmp_path / "bad.jsonl"), "--tokenizer", str(tmp_path / "no.json")): "no such file",
    }
    for argv, sentence in cases.items():
        assert sentence in _refused(capsys, tmp_path, *argv), argv
    (tmp_path / "new" / "out").mkdir(parents=True)
    (tmp_path / "new" / "out" / "mine.txt").write_text("someone's file")
    with pytest.raises(SystemExit):
        prepare_data.main([str(tmp_path / "latin1" / "a.txt"), "--out", str(tmp_path / "new" / "out")])
    assert "is not a prepared data folder" in capsys.readouterr().err
    assert (tmp_path / "new" / "out" / "mine.txt").exists()


def test_a_failure_while_writing_leaves_the_folder_as_it_was(src, bpe, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(bpe, out)
    before = _files(out)

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(prepared, "write_shard", full_disk)
    with pytest.raises(OSError):
        _prepare(src, out, "--tokenizer", "bytes")
    assert _files(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_damaged_prepared_folder_is_refused_in_one_sentence(bpe, tmp_path):
    def damaged(name, how) -> str:
        folder = tmp_path / name
        shutil.copytree(bpe, folder)
        how(folder)
        with pytest.raises(UserError) as e:
            load_corpus(str(folder), vocab_size=VOCAB)
        return str(e.value)
    shard = "train_000001.bin"
    assert "has changed since it was prepared" in damaged("short", lambda f: (f / shard).write_bytes(
        (f / shard).read_bytes()[:-2]))
    header = lambda f: (f / shard).write_bytes(  # noqa: E731  (the count says 3999: the size no longer fits)
        (f / shard).read_bytes()[:12] + (3999).to_bytes(4, "little") + (f / shard).read_bytes()[16:])
    assert "has changed since it was prepared" in damaged("header", header)
    assert "is not a token shard" in damaged("garbage", lambda f: (f / shard).write_bytes(b"\0" * 2000))
    assert "tokenizer.json is missing or has changed" in damaged(
        "tokenizer", lambda f: (f / "tokenizer.json").write_text("{}"))
    assert "holds token shards or a tokenizer but no meta.json" in damaged(
        "nometa", lambda f: (f / "meta.json").unlink())
    assert "is not one that python -m tools.prepare_data writes" in damaged(
        "badmeta", lambda f: (f / "meta.json").write_text("[1, 2]"))


# ---- using the trained model: its tokenizer in tools.generate and tools.export_hf ------------------
def _tool(main, argv, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_speaks_the_runs_tokenizer(runs, bpe, src, tmp_path, capsys):
    from tokenizers import Tokenizer

    from common.generate import generate, load_trained
    from tools.generate import main
    code, out, err = _tool(main, [str(runs / "one"), "--prompt", "def ", "--max-new-tokens", "12", "--temperature", "0",
                                  "--device", "cpu"], capsys)
    assert code == 0, err
    tok = Tokenizer.from_file(str(bpe / "tokenizer.json"))
    prompt = [0, *tok.encode("def ").ids]  # a prompt starts a document: after the end-of-text token
    trained = load_trained(runs / "one")
    tokens, _ = generate(trained.model, torch.tensor([prompt]), 12, trained.context)
    assert out.splitlines()[1:-1] == ("def " + tok.decode(tokens[0, len(prompt):].tolist(),
                                                          skip_special_tokens=False)).splitlines()
    # the data folder moved: one sentence, then --tokenizer
    moved = tmp_path / "moved"
    shutil.copytree(runs / "one", moved)
    summary = json.loads((moved / "summary.json").read_text())
    (moved / "summary.json").write_text(json.dumps(summary | {"data": str(tmp_path / "gone")}))
    code, out, err = _tool(main, [str(moved), "--prompt", "def ", "--device", "cpu"], capsys)
    assert code == 2 and err.strip() == (f"error: {moved / 'weights.pt'} was trained on the prepared folder "
                                         f"{tmp_path / 'gone'}, which is not there any more; give its tokenizer: "
                                         f"--tokenizer PATH/tokenizer.json."), err
    code, out, err = _tool(main, [str(moved), "--prompt", "def ", "--max-new-tokens", "12", "--temperature", "0",
                                  "--device", "cpu", "--tokenizer", str(bpe / "tokenizer.json")], capsys)
    assert code == 0 and out.splitlines()[1:-1] == ("def " + tok.decode(tokens[0, len(prompt):].tolist(),
                                                                        skip_special_tokens=False)).splitlines()
    raw = _prepare(src, tmp_path / "bytes", "--tokenizer", "bytes")
    code, out, err = _tool(main, [str(moved), "--prompt", "def ", "--device", "cpu", "--tokenizer", str(raw)], capsys)
    assert code == 2 and f"{raw}'s tokenizer has 257 tokens and the model of {moved / 'weights.pt'} 300" in err


def test_export_hf_writes_the_runs_tokenizer(runs, bpe, tmp_path):
    import transformers
    from tokenizers import Tokenizer

    from common.generate import load_trained
    from tools.export_hf import compare, export
    export(runs / "one", tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = Tokenizer.from_file(str(bpe / "tokenizer.json"))
    text = UNICODE.replace(prepared.EOT, "") + "def f(x):\n    return x\n"
    assert tok(text).input_ids == ours.encode(text).ids and tok.decode(tok(text).input_ids) == text
    assert tok.eos_token == tok.bos_token == prepared.EOT and tok.eos_token_id == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert hf.config.vocab_size == VOCAB and hf.config.eos_token_id == hf.config.bos_token_id == 0
    x = torch.tensor([[0, *ours.encode(text).ids]])
    with torch.no_grad():
        assert (hf(x).logits - load_trained(runs / "one").model(x)).abs().max().item() < 1e-5
    assert compare(runs / "one", tmp_path / "hf") < 1e-5


def test_the_estimator_and_the_planner_take_the_vocabulary_of_prepared_data(bpe, capsys):
    """--data DIR gives the estimator and the planner the tokenizer's vocabulary, as a script
    takes it: the same numbers as --vocab-size of that size; the planner's commands train on
    the folder; a folder that is not prepared, or a --vocab-size that disagrees, is one sentence."""
    from tools import estimate, plan

    flags = ["--model", "small", "--world-size", "2", "--strategy", "fsdp", "--batch", "4", "--seq-len", "64"]
    estimate.main([*flags, "--data", str(bpe)])
    by_data = capsys.readouterr().out
    estimate.main([*flags, "--vocab-size", str(VOCAB)])
    assert by_data == capsys.readouterr().out
    estimate.main(flags)
    assert capsys.readouterr().out != by_data  # (256 bytes: another model)
    pflags = ["--model", "small", "--gpus", "2", "--gpu", "h100", "--global-batch-size", "8", "--seq-len", "256",
              "--top", "2"]
    plan.main([*pflags, "--data", str(bpe)])
    planned = capsys.readouterr().out
    plan.main([*pflags, "--vocab-size", str(VOCAB)])
    by_vocab = capsys.readouterr().out
    assert f"--data {bpe}" in planned and "--data synthetic" not in planned and "--vocab-size" not in planned
    assert planned.replace(f"--data {bpe}", f"--vocab-size {VOCAB} --data synthetic") == by_vocab
    for tool, argv in ((estimate, flags), (plan, pflags)):
        with pytest.raises(SystemExit) as e:
            tool.main([*argv, "--data", str(bpe.parent)])
        assert e.value.code == 2
        assert capsys.readouterr().err.strip() == (f"error: --data {bpe.parent} is not a folder python -m "
                                                    f"tools.prepare_data wrote (no meta.json there); give one, or "
                                                    f"--vocab-size alone.")
        with pytest.raises(SystemExit):
            tool.main([*argv, "--data", str(bpe), "--vocab-size", str(VOCAB + 1)])
        assert f"--vocab-size {VOCAB + 1} disagrees with --data {bpe}" in capsys.readouterr().err


# ---- what the corpus's size costs: python -m tools.bench_data ------------------------------
def test_the_data_benchmark_prints_each_runs_memory_and_wait(tmp_path):
    """tools.bench_data at toy sizes: a row per corpus, its numbers the training run's own
    (summary.json's data wait, step time and their share; the shards meta.json lists), the
    shards dropped from the file cache first, and the closing line's ratio that of the rows."""
    import re
    r = launch.run([sys.executable, "-m", "tools.bench_data", "--tokens", "2e5,1e6", "--model", "debug", "--steps",
                    "4", "--seq-len", "64", "--global-batch-size", "4", "--device", "cpu", "--out",
                    str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert "the shards dropped from the file cache before each run" in lines[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if re.match(r"\| [\d,]+ \|", line)]
    assert len(rows) == 2
    from common.measure.byte_units import fmt_bytes
    kept = json.loads((tmp_path / "bench_data.json").read_text())
    for n, row, k in zip((200_000, 1_000_000), rows, kept, strict=True):
        meta = json.loads((tmp_path / f"data_{n}" / "meta.json").read_text())
        s = json.loads((tmp_path / f"run_{n}" / "summary.json").read_text())
        assert s["data"] == str(tmp_path / f"data_{n}") and s["steps"] == 4
        assert row[0] == f"{meta['splits']['train']['tokens']:,}" and meta["splits"]["train"]["tokens"] >= n * 0.9
        assert row[1] == fmt_bytes(sum(sh["bytes"] for sp in meta["splits"].values() for sh in sp["shards"]))
        assert row[2] == fmt_bytes(k["peak_rss_bytes"]) and k["peak_rss_bytes"] > 50 * 2**20  # (torch alone is more)
        assert row[3:] == [f"{s['data_wait_s'] * 1e3:.2f} ms", f"{s['step_time_s'] * 1e3:,.0f} ms",
                           f"{s['data_wait_share']:.2%}"]
    rss = [k["peak_rss_bytes"] for k in kept]
    assert f"the peak resident memory changed {max(rss) / min(rss):.2f}x" in lines[-1]
    bad = launch.run([sys.executable, "-m", "tools.bench_data", "--tokens", "1e7,5"], cwd=ROOT,
                     capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: --tokens 5: give whole token counts of 100000 or more, comma-separated (1e7,1e9)."]
