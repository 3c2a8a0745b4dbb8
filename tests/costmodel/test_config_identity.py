"""``ParallelConfig`` keys the planner's caches: its cached hash and its equality must agree
with its fields whichever way a configuration was made (constructor, ``replace``,
``with_split``, a pickle from another process)."""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys

from meshplan.costmodel import ParallelConfig

BASE = ParallelConfig(tp=2, pp=4, dp=2, cp=2, sp=True, micro_batch_size=2, global_batch_size=16,
                      seq_len=4096, vpp=2, recompute="selective", zero_stage=1)


def _fields(config: ParallelConfig) -> tuple:
    return tuple(getattr(config, f.name) for f in dataclasses.fields(config))


def test_equal_fields_are_equal_configs_with_equal_hashes():
    twin = ParallelConfig(**{f.name: getattr(BASE, f.name) for f in dataclasses.fields(BASE)})
    hash(BASE)  # one cached, the other not yet
    assert twin == BASE and hash(twin) == hash(BASE) and {BASE: 1}[twin] == 1
    for change in (dict(tp=4, sp=False), dict(zero_stage=2), dict(mesh_order=("tp", "dp", "cp",
                                                                               "pp")),
                   dict(recompute=("full", "none", "none", "none"))):
        other = BASE.replace(**change)
        assert other != BASE and _fields(other) != _fields(BASE)
        assert other == BASE.replace(**change) and hash(other) == hash(BASE.replace(**change))
    assert BASE != _fields(BASE) and (BASE == 3) is False


def test_a_split_copy_does_not_keep_the_hash_of_its_source():
    hash(BASE)
    split = BASE.with_split((8, 8, 8, 8), ("full", "none", "none", "none"))
    same = BASE.replace(layers_per_stage=(8, 8, 8, 8), recompute=("full", "none", "none", "none"))
    assert split == same and hash(split) == hash(same) and split != BASE


def test_a_pickle_hashes_by_its_own_process():
    hash(BASE)
    assert "_hash" not in pickle.loads(pickle.dumps(BASE)).__dict__
    # another interpreter (another string-hash seed) reads it back equal and hashable
    code = ("import pickle, sys; c = pickle.loads(sys.stdin.buffer.read()); "
            "from meshplan.costmodel import ParallelConfig; "
            "d = ParallelConfig(**{k: getattr(c, k) for k in c.__dataclass_fields__}); "
            "assert c == d and hash(c) == hash(d) and {c: 1}[d] == 1; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(BASE),
                         capture_output=True, timeout=120,
                         env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert out.stdout.strip() == b"ok", out.stderr.decode()[-2000:]

