"""Text corpora for ``meshplan run --data``: tokenized once, packed, then read like a token file.

``--data PATH`` is a token file (``data.py``), or text: ``.jsonl`` (one JSON object per line,
the document in ``--text-field``, default ``text``), ``.txt`` (documents separated by blank
lines), ``.parquet`` (the ``--text-field`` column) or a folder saved by HF ``datasets``
(``save_to_disk``; a ``DatasetDict``'s ``train`` split). Before any worker starts,
``prepare`` tokenizes every document with ``--tokenizer`` (a ``tokenizer.json`` or a folder
holding one; default: the ``--init-from`` folder), appends the tokenizer's EOS id to each and
concatenates them into a flat token file (documents packed to the plan's sequence length by
``data.py``'s windows; every token counts in the loss). The file is cached under a name made
from the corpus' and the tokenizer's contents (``<cache>/tokens-<sha256>.bin``; the cache is
``--checkpoint-dir``/data when given, so every node and every resume reads the same file).
Text runs shuffle their windows with the run's seed (``DataSpec.shuffle``): the order is a
function of seed and step, so a resumed run continues with exactly the samples an uninterrupted
one would have seen (the loader's state is the step count the checkpoint holds).

Refused with one line before any worker starts: no such file, no documents (an empty file, no
text in the field), a missing field, a tokenizer without an EOS token, a tokenizer whose
vocabulary is larger than the model's.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

TEXT_SUFFIXES = (".jsonl", ".txt", ".parquet")
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]")
"""Tokens taken as EOS when ``tokenizer_config.json`` names none."""


def is_text(path: str) -> bool:
    """True when ``--data path`` is a text corpus rather than a token file."""
    return os.path.isdir(path) or Path(path).suffix in TEXT_SUFFIXES


def documents(path: str, field: str) -> Iterator[str]:
    """The corpus' documents, in order; ValueError (one line) for a missing field."""
    suffix = Path(path).suffix
    if os.path.isdir(path):
        yield from _column(_load_from_disk(path), field, path)
    elif suffix == ".jsonl":
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as err:
                    raise ValueError(f"--data {path}: line {number} is not JSON ({err})") from None
                if not isinstance(record, dict) or field not in record:
                    raise ValueError(f"--data {path}: line {number} has no {field!r} field "
                                     "(--text-field names it)")
                yield str(record[field])
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if field not in table.column_names:
            raise ValueError(f"--data {path}: no column {field!r} (columns: "
                             f"{', '.join(table.column_names)}; --text-field names it)")
        yield from (str(v) for v in table.column(field).to_pylist() if v is not None)
    else:
        with open(path, encoding="utf-8") as handle:
            yield from (part for part in handle.read().split("\n\n") if part.strip())


def _load_from_disk(path: str):
    try:
        import datasets
    except ImportError:
        raise ValueError(f"--data {path}: a dataset folder needs the datasets package "
                         "(pip install datasets)") from None
    try:
        data = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError) as err:
        raise ValueError(f"--data {path}: not a dataset saved with save_to_disk ({err})") from None
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise ValueError(f"--data {path}: a DatasetDict without a train split "
                             f"({', '.join(data)})")
        data = data["train"]
    return data


def _column(data, field: str, path: str) -> Iterator[str]:
    if field not in data.column_names:
        raise ValueError(f"--data {path}: no column {field!r} (columns: "
                         f"{', '.join(data.column_names)}; --text-field names it)")
    yield from (str(v) for v in data[field] if v is not None)


def tokenizer_file(path: str) -> str:
    """``tokenizer.json`` of ``--tokenizer path`` (the file, or a folder holding it)."""
    candidate = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(candidate):
        raise ValueError(f"--tokenizer {path}: no tokenizer.json")
    return candidate


def eos_id(tokenizer, file: str) -> int:
    """The EOS id: ``tokenizer_config.json``'s ``eos_token`` next to ``file``, else a common
    EOS token of the vocabulary."""
    config = os.path.join(os.path.dirname(file), "tokenizer_config.json")
    names = list(EOS_NAMES)
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as handle:
            try:
                settings = json.load(handle)
            except json.JSONDecodeError as error:
                raise ValueError(f"{config}: not valid JSON: {error}") from None
        eos = settings.get("eos_token") if isinstance(settings, dict) else None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            names.insert(0, eos)
    for name in names:
        token = tokenizer.token_to_id(name)
        if token is not None:
            return token
    raise ValueError(f"--tokenizer {file}: no EOS token (none of {', '.join(names)}); "
                     "documents are packed with one")


def _digest(*paths: str) -> str:
    digest = hashlib.sha256()
    for path in paths:
        files = sorted(p for p in Path(path).rglob("*") if p.is_file()) if os.path.isdir(
            path) else [Path(path)]
        for file in files:
            digest.update(str(file.relative_to(path) if os.path.isdir(path) else "").encode())
            with open(file, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()[:20]


def prepare(path: str, *, tokenizer: str, field: str, vocab_size: int,
            cache_dir: str | None) -> str:
    """The token file of corpus ``path`` (made once, then cached); ValueError (one line) for
    bad data or a tokenizer that does not fit the model."""
    from tokenizers import Tokenizer

    if not os.path.exists(path):
        raise ValueError(f"--data {path!r}: no such file or folder")
    file = tokenizer_file(tokenizer)
    try:
        tok = Tokenizer.from_file(file)
    except Exception as error:  # the tokenizers library raises a bare Exception
        raise ValueError(f"--tokenizer {file}: not a tokenizers JSON file "
                         f"({str(error).splitlines()[0] if str(error) else type(error).__name__})"
                         ) from None
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"--tokenizer {tokenizer}: its vocabulary has {tok.get_vocab_size()} "
                         f"tokens, more than the model's {vocab_size}")
    eos = eos_id(tok, file)
    dtype = np.uint16 if vocab_size <= 2 ** 16 else np.int32
    folder = cache_dir or os.path.join(tempfile.gettempdir(), "meshplan-data")
    os.makedirs(folder, exist_ok=True)
    out = os.path.join(folder, f"tokens-{_digest(path, file)}-{field}.bin")
    if os.path.isfile(out):
        return out
    ids: list[int] = []
    count = 0
    for text in documents(path, field):
        if text.strip():
            ids.extend(tok.encode(text, add_special_tokens=False).ids)
            ids.append(eos)
            count += 1
    if not count:
        raise ValueError(f"--data {path}: no documents with text")
    tmp = f"{out}.{os.getpid()}.tmp"
    np.asarray(ids, dtype=dtype).tofile(tmp)
    os.replace(tmp, out)
    return out
