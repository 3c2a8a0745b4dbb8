"""Text corpora for ``--data``: tokenized with an offline-built tokenizer, packed with EOS,
shuffled by seed, resumed exactly, and every bad-data case refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from meshplan.runtime import corpus
from meshplan.runtime import data as data_mod
from meshplan.testing import run_cli

tokenizers = pytest.importorskip("tokenizers")

DOCS = ["the cat sat on the mat", "a dog ran in the park", "the mat was red and the cat slept",
        "birds sing in the morning light"] * 8
VOCAB = 64


def _tokenizer(folder: Path, *, eos: bool = True) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>", "</s>"] if eos else ["<unk>"]
    tok.train_from_iterator(DOCS, trainers.WordLevelTrainer(special_tokens=specials))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _write(folder: Path, kind: str, docs: list[str] = DOCS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl":
        path = folder / "c.jsonl"
        path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    elif kind == "txt":
        path = folder / "c.txt"
        path.write_text("\n\n".join(docs) + "\n")
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = folder / "c.parquet"
        pq.write_table(pa.table({"text": docs}), path)
    else:
        datasets = pytest.importorskip("datasets")
        path = folder / "ds"
        datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(path))
    return path


@pytest.fixture
def tok(tmp_path) -> Path:
    return _tokenizer(tmp_path / "tok")


@pytest.mark.parametrize("kind", ["jsonl", "txt", "parquet", "dataset"])
def test_every_format_packs_the_same_tokens_with_eos(tmp_path, tok, kind):
    from tokenizers import Tokenizer

    path = _write(tmp_path / kind, kind)
    out = corpus.prepare(str(path), tokenizer=str(tok), field="text", vocab_size=VOCAB,
                         cache_dir=str(tmp_path / "cache"))
    tokens = np.fromfile(out, dtype=np.uint16).tolist()
    t = Tokenizer.from_file(str(tok / "tokenizer.json"))
    eos = t.token_to_id("</s>")
    expected = [i for d in DOCS for i in t.encode(d).ids + [eos]]
    assert tokens == expected
    assert corpus.prepare(str(path), tokenizer=str(tok), field="text", vocab_size=VOCAB,
                          cache_dir=str(tmp_path / "cache")) == out  # cached


def test_shuffled_windows_cover_each_pass_once_and_depend_on_the_seed(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(40 * 9, dtype=np.uint16).tofile(path)  # 40 windows of s + 1 = 9 tokens
    spec = data_mod.DataSpec(global_batch_size=8, seq_len=8, vocab_size=2 ** 16,
                             token_file=str(path), shuffle=True)
    first_pass = [int(r[0]) // 9 for step in range(5)
                  for r in data_mod.global_batch(spec, step)]
    assert sorted(first_pass) == list(range(40)) and first_pass != list(range(40))
    other = data_mod.DataSpec(**{**spec.__dict__, "seed": 1})
    assert not np.array_equal(data_mod.global_batch(spec, 0), data_mod.global_batch(other, 0))
    assert np.array_equal(data_mod.global_batch(spec, 7), data_mod.global_batch(spec, 7))
    assert all((np.diff(row.numpy()) == 1).all() for row in data_mod.global_batch(spec, 3))


@pytest.mark.parametrize("case, message", [
    ("empty", "no documents with text"),
    ("no_field", "line 1 has no 'text' field"),
    ("big_vocab", "more than the model's 8"),
    ("no_eos", "no EOS token"),
    ("no_tokenizer", "no tokenizer.json"),
    ("bad_tokenizer", "not a tokenizers JSON file"),
    ("bad_tokenizer_config", "tokenizer_config.json: not valid JSON"),
])
def test_bad_data_is_one_line(tmp_path, tok, case, message):
    path, tokenizer, vocab = _write(tmp_path, "jsonl"), tok, VOCAB
    if case == "empty":
        path.write_text("")
    elif case == "no_field":
        path.write_text(json.dumps({"body": "x"}) + "\n")
    elif case == "big_vocab":
        vocab = 8
    elif case == "no_eos":
        tokenizer = _tokenizer(tmp_path / "plain", eos=False)
    elif case == "bad_tokenizer":
        tokenizer = tmp_path / "broken.json"
        tokenizer.write_text("not json")
    elif case == "bad_tokenizer_config":
        (tok / "tokenizer_config.json").write_text("{eos")
    else:
        tokenizer = tmp_path
    with pytest.raises(ValueError, match=message):
        corpus.prepare(str(path), tokenizer=str(tokenizer), field="text", vocab_size=vocab,
                       cache_dir=str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def text_plan(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    done = run_cli("plan", "--model", "tiny", "--cluster", "cpu", "--nodes", "1",
                   "--gpus-per-node", "1", "--global-batch", "4", "--seq-len", "8",
                   "--dtype", "fp32", "--deterministic", "-o", str(path))
    assert done.code == 0, done.err
    return path


def test_run_refuses_bad_text_data_before_any_worker(tmp_path, tok, text_plan):
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    done = run_cli("run", str(text_plan), "--data", str(empty), "--tokenizer", str(tok))
    assert done.code == 2 and done.err.count("\n") == 1 and "no documents" in done.err
    done = run_cli("run", str(text_plan), "--data", str(_write(tmp_path, "jsonl")))
    assert done.code == 2 and "needs --tokenizer" in done.err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_after_a_kill_continues_with_the_same_samples(tmp_path, tok, text_plan,
                                                             meshplan):
    data = _write(tmp_path, "jsonl")
    common = ("run", str(text_plan), "--data", str(data), "--tokenizer", str(tok), "--steps",
              "6", "--json", "--oversubscribe")
    whole = meshplan(*common, timeout_s=150)
    assert whole.returncode == 0, whole.stderr[-3000:]
    env = {"MESHPLAN_FAULT_AT_STEP": "3", "MESHPLAN_FAULT_MARKER": str(tmp_path / "fired")}
    killed = meshplan(*common, "--checkpoint-dir", str(tmp_path / "ckpt"),
                      "--checkpoint-every", "2", "--max-restarts", "1", env=env,
                      timeout_s=150)
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert (tmp_path / "fired").exists()
    resumed = json.loads(killed.stdout)
    assert resumed["resumed_from_step"] == 2
    assert resumed["losses"] == json.loads(whole.stdout)["losses"]
