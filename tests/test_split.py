"""Split GGUF sets (written by gguf-py's own splitter) are one model for every command."""

from __future__ import annotations

import hashlib
import shutil

import numpy as np
import pytest
from gguf import GGUFReader
from typer.testing import CliRunner

from _split_util import split_with_gguf_py
from mbolt.cli import app
from mbolt.core.errors import MboltError
from mbolt.core.gguf_set import open_model_header
from mbolt.core.moe_map import moe_map
from mbolt.synth.synth import SynthConfig, write_synth
from mbolt.rewrite.outplan import SplitSpec
from mbolt.rewrite.reorder import reorder
from mbolt.rewrite.verify import verify

runner = CliRunner()


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_error_line(res, *needles):
    assert res.exit_code == 2, res.output
    lines = [x for x in res.output.strip().splitlines() if x.strip()]
    assert len(lines) == 1, res.output
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def perm_for(m, seed):
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(m.n_experts) for _ in range(m.n_layers)])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("split")
    src = write_synth(d / "m.gguf", SynthConfig(arch="qwen3moe", n_layers=4, n_experts=8, n_used=2,
                                                expert_type="Q8_0", seed=3))
    shards = split_with_gguf_py(src, d / "set.gguf", max_tensors=20)
    return src, shards


def gguf_py_tensors(path):
    """name -> (shard-local bytes) with gguf-py's reader, the independent check."""
    return {t.name: bytes(np.asarray(t.data).tobytes()) for t in GGUFReader(str(path)).tensors}


def test_any_shard_opens_the_whole_set(model):
    src, shards = model
    assert len(shards) == 3
    one = moe_map(src)
    for s in shards:
        m = moe_map(s)
        assert m.paths == [str(p) for p in shards]
        assert [layer.dense for layer in m.layers] == [layer.dense for layer in one.layers]
        assert len(m.header.tensors) == len(one.header.tensors)
    m = moe_map(shards[2])
    # every tensor knows its shard and offset: its bytes there are gguf-py's bytes of that shard
    per_shard = [gguf_py_tensors(p) for p in shards]
    for t in m.header.tensors:
        with open(m.paths[t.file], "rb") as f:
            f.seek(t.data_offset)
            assert f.read(t.nbytes) == per_shard[t.file][t.name], t.name
    assert {t.file for t in m.header.tensors} == {0, 1, 2}
    # layer 1's experts live in shard 2 (gguf-py cut after 20 tensors)
    assert {w.file for w in m.layers[1].weights} == {1}
    # the set fingerprint is stable and differs from every shard's own
    assert m.fingerprint == moe_map(shards[0]).fingerprint
    assert m.fingerprint not in {s.fingerprint for s in m.header.shards}
    d = m.to_dict()
    assert [f["n_tensors"] for f in d["files"]] == [len(GGUFReader(str(p)).tensors) for p in shards]


def test_inspect_any_shard(model):
    _, shards = model
    res = cli("inspect", shards[1], "--json")
    assert res.exit_code == 0, res.output
    assert '"dense": false' in res.output and "00003-of-00003" in res.output


def test_bad_sets_are_one_error_line(model, tmp_path):
    src, shards = model
    d = tmp_path / "bad"
    d.mkdir()
    # missing shard
    for p in shards[:1] + shards[2:]:
        shutil.copy(p, d / p.name)
    one_error_line(cli("inspect", d / shards[0].name), "missing shard 2 of 3", shards[1].name)
    # a shard of another set: another model split the same way
    other = write_synth(tmp_path / "o.gguf", SynthConfig(arch="qwen3moe", n_layers=5, n_experts=8, n_used=2,
                                                         expert_type="Q8_0", seed=4))
    oshards = split_with_gguf_py(other, tmp_path / "oset.gguf", max_tensors=20)
    assert len(oshards) == 4
    shutil.copy(oshards[1], d / shards[1].name.replace("00002-of-00003", "00002-of-00003"))
    line = one_error_line(cli("inspect", d / shards[0].name), "another set")
    assert shards[1].name in line
    # wrong count: a shard renamed into a set of another size
    e = tmp_path / "count"
    e.mkdir()
    for i, p in enumerate(shards):
        shutil.copy(p, e / f"x-{i + 1:05d}-of-00004.gguf")
    one_error_line(cli("inspect", e / "x-00001-of-00004.gguf"), "split.count says 3")
    # a shard missing its split keys among named shards
    f = tmp_path / "nosplit"
    f.mkdir()
    shutil.copy(src, f / "y-00001-of-00002.gguf")
    one_error_line(cli("inspect", f / "y-00001-of-00002.gguf"), "no split.count")


def test_mixed_old_and_new_shards_are_refused(model, tmp_path):
    _, shards = model
    m = moe_map(shards[0])
    a = reorder(m, tmp_path / "a.gguf", perm_for(m, 1))
    b = reorder(m, tmp_path / "b.gguf", perm_for(m, 2))
    assert len(a.files) == 3 and len(b.files) == 3
    shutil.copy(b.files[1], a.files[1])  # shard 2 of another run
    with pytest.raises(MboltError, match="another set .*mbolt.set.id"):
        moe_map(a.files[0])
    res = cli("verify", shards[0], a.files[2], "--no-parity", "--json")  # verify's verdict: the output is bad
    assert res.exit_code == 1 and "belongs to another set" in res.output
    one_error_line(cli("verify", a.files[2], shards[0], "--no-parity"), "belongs to another set")


def test_reorder_set_keeps_the_input_shards_and_verifies(model, tmp_path):
    src, shards = model
    m = moe_map(shards[1])
    perm = perm_for(m, 5)
    for layout in ("reorder", "packed"):
        res = reorder(m, tmp_path / f"{layout}.gguf", perm, layout=layout)
        assert [p.split("/")[-1] for p in res.files] == [f"{layout}-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
        out = moe_map(res.files[1])
        if layout == "reorder":  # the input's tensor-to-shard assignment, by gguf-py's reader
            assert [sorted(t.name for t in GGUFReader(p).tensors) for p in res.files] == \
                   [sorted(t.name for t in GGUFReader(str(p)).tensors) for p in shards]
        else:  # a packed blob lies in one shard, with its layer's other tensors
            for layer in out.moe_layers:
                assert len({w.file for w in layer.weights}) == 1
        # route map in shard 1 only; every shard names the set
        ids = set()
        for i, p in enumerate(res.files):
            r = GGUFReader(p)
            keys = set(r.fields)
            assert ("mbolt.perm" in keys) == (i == 0)
            ids.add(bytes(r.fields["mbolt.set.id"].parts[-1]))
            assert int(r.fields["split.no"].parts[-1][0]) == i
        assert len(ids) == 1
        assert np.array_equal(out.route_map.perm, perm)
        rep = verify(shards[2], res.files[2])
        assert rep.ok, [c for c in rep.checks if c.ok is False]
        assert next(c for c in rep.checks if c.name == "header").detail.endswith("in 3 shards")
    # verify also accepts the path given to reorder
    res = cli("verify", shards[0], tmp_path / "reorder.gguf", "--no-parity")
    assert res.exit_code == 0, res.output


def test_split_options_and_verify_across_forms(model, tmp_path):
    src, shards = model
    m = moe_map(shards[0])
    perm = perm_for(m, 6)
    one = reorder(m, tmp_path / "one.gguf", perm, split=SplitSpec(no_split=True))
    assert one.files == [str(tmp_path / "one.gguf")]
    assert len(GGUFReader(one.dst).tensors) == len(m.header.tensors)
    assert "split.count" not in GGUFReader(one.dst).fields
    assert verify(shards[0], one.dst).ok  # set -> one file
    many = reorder(src, tmp_path / "many.gguf", perm, split=SplitSpec(max_tensors=10))  # one file -> set
    n = len(many.files)
    assert n == -(-len(m.header.tensors) // 10)
    assert all(len(GGUFReader(p).tensors) <= 10 for p in many.files)
    assert verify(src, many.files[-1]).ok
    sized = reorder(src, tmp_path / "sized.gguf", perm, split=SplitSpec(max_size=200_000), layout="packed")
    assert len(sized.files) > 1
    assert verify(src, sized.dst).ok
    with pytest.raises(MboltError, match="cannot be combined"):
        reorder(src, tmp_path / "x.gguf", perm, split=SplitSpec(no_split=True, max_tensors=3))
    # CLI spelling
    res = cli("reorder", shards[0], tmp_path / "cli.gguf", "--identity", "--split-max-size", "256K", "--json")
    assert res.exit_code == 0, res.output
    assert "cli-00001-of-" in res.output
    one_error_line(cli("reorder", shards[0], tmp_path / "y.gguf", "--identity", "--split-max-size", "lots"),
                   "--split-max-size")


def test_verify_names_the_shard_and_tensor(model, tmp_path):
    _, shards = model
    m = moe_map(shards[0])
    res = reorder(m, tmp_path / "o.gguf", perm_for(m, 7))
    out = moe_map(res.files[0])
    t = next(t for t in out.header.tensors if t.file == 2 and t.name.endswith("ffn_down_exps.weight"))
    with open(res.files[2], "r+b") as f:
        f.seek(t.data_offset + 5)
        b = f.read(1)
        f.seek(t.data_offset + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    rep = verify(shards[0], res.files[0])
    assert not rep.ok
    mm = rep.mismatches[0]
    assert mm.tensor == t.name and mm.file == res.files[2] and mm.position == 0 and mm.offset == 5
    assert res.files[2].split("/")[-1] in str(mm)


def test_verify_checks_alignment_padding(model, tmp_path):
    src, _ = model
    res = reorder(src, tmp_path / "p.gguf", None)
    h = open_model_header(res.dst)
    t = h.tensors[0]
    pad_at = t.data_offset + t.nbytes  # the padding up to the next 4 KiB boundary
    assert h.tensors[1].data_offset > pad_at
    with open(res.dst, "r+b") as f:
        f.seek(pad_at + 1)
        f.write(b"\x01")
    rep = verify(src, res.dst)
    assert not rep.ok
    c = next(c for c in rep.checks if c.name == "padding")
    assert c.ok is False
    assert rep.mismatches[0].tensor == f"padding after {t.name}" and rep.mismatches[0].offset == 1


def test_verify_of_a_missing_path_is_one_error(model, tmp_path):
    src, _ = model
    one_error_line(cli("verify", src, tmp_path / "nope.gguf"), "nope.gguf", "no such file")
    one_error_line(cli("verify", tmp_path / "nope.gguf", src), "no such file")


def test_interrupted_set_rename_leaves_nothing_accepted(model, tmp_path, monkeypatch):
    import os

    import mbolt.rewrite.reorder as R

    _, shards = model
    m = moe_map(shards[0])
    old = reorder(m, tmp_path / "o.gguf", perm_for(m, 1))
    real = os.replace
    calls = []

    def dying_replace(a, b):
        calls.append(b)
        if len(calls) == 3:  # sidecar, shard 3, then die before shard 2
            raise KeyboardInterrupt
        real(a, b)
    monkeypatch.setattr(R.os, "replace", dying_replace)
    with pytest.raises(KeyboardInterrupt):
        reorder(m, tmp_path / "o.gguf", perm_for(m, 2), force=True)
    monkeypatch.setattr(R.os, "replace", real)
    # the mix of old shards 1-2 and the new shard 3 is refused by every reader
    for p in old.files:
        with pytest.raises(MboltError, match="another set"):
            moe_map(p)
    one_error_line(cli("inspect", old.files[0]), "another set")
    assert not list(tmp_path.glob(".o-0000*.part"))  # no temp file left
    # the next run (even without --force) removes the condemned shards and writes the set
    res = reorder(m, tmp_path / "o.gguf", perm_for(m, 3))
    assert any(p.endswith(".journal") for p in res.removed_stale)
    assert verify(shards[0], res.files[0]).ok
    assert not list(tmp_path.glob(".o.gguf.*"))


def test_killed_set_write_leaves_no_shard(model, tmp_path):
    import signal
    import subprocess
    import sys
    import textwrap

    _, shards = model
    # the copy stops after its first range and waits on stdin (never written): killed mid-write, no race
    child = textwrap.dedent("""
        import sys
        import mbolt.rewrite.copy as C
        import mbolt.rewrite.reorder as R
        orig = C.Copier.copy
        def held(self, s, d, k):
            orig(self, s, d, k)
            print("COPYING", flush=True)
            sys.stdin.readline()
        C.Copier.copy = held
        R.reorder(sys.argv[1], sys.argv[2], None)
    """)
    p = subprocess.Popen([sys.executable, "-c", child, str(shards[0]), str(tmp_path / "k.gguf")],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "COPYING", p.stderr.read()
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert not list(tmp_path.glob("k-*.gguf"))  # no output shard
    parts = list(tmp_path.glob(".k-*.part"))
    assert len(parts) == 3
    res = reorder(shards[0], tmp_path / "k.gguf", None)
    assert sorted(res.removed_stale) == sorted(map(str, parts))
    assert not list(tmp_path.glob(".k-*"))


def test_reorder_never_writes_over_inputs_or_their_source(model, tmp_path):
    src, shards = model
    work = tmp_path / "w"
    work.mkdir()
    m_gguf = work / "model.gguf"
    shutil.copy(src, m_gguf)
    before = sha(m_gguf)
    packed = reorder(m_gguf, work / "model.packed.gguf", None, layout="packed")
    # arguments swapped: the original model the packed file was made from is never replaced
    one_error_line(cli("reorder", packed.dst, m_gguf, "--identity", "--force"), "model an input was made from")
    assert sha(m_gguf) == before
    # nor a shard of the set an input was made from
    s = work / "s"
    s.mkdir()
    for p in shards:
        shutil.copy(p, s / p.name)
    sp = reorder(s / shards[0].name, work / "sp.gguf", None, layout="packed")
    one_error_line(cli("reorder", sp.files[0], s / "set.gguf", "--identity", "--force"), "model an input was made from")
    assert sha(s / shards[1].name) == sha(shards[1])
    # nor the plan or trace it reads
    from mbolt.core.plan import Plan, save_plan

    m = moe_map(m_gguf)
    plan = work / "p.json"
    save_plan(plan, Plan("test", m.n_layers, m.n_experts, perm_for(m, 1), np.zeros((m.n_layers, m.n_experts)), {}))
    plan_before = sha(plan)
    one_error_line(cli("reorder", m_gguf, plan, "--plan", plan, "--force"), "is an input")
    assert sha(plan) == plan_before
    # --force replaces a previous output only
    other = work / "notes.gguf"
    other.write_text("mine")
    one_error_line(cli("reorder", m_gguf, other, "--identity", "--force"), "not a previous rewritten model")
    assert other.read_text() == "mine"


def test_concurrent_writer_is_refused(model, tmp_path):
    from mbolt.rewrite.setwriter import output_lock

    src, _ = model
    out = tmp_path / "c.gguf"
    with output_lock(out):
        with pytest.raises(MboltError, match="another mbolt reorder is writing"):
            reorder(src, out, None)
    assert not out.exists()
    reorder(src, out, None)
    assert not list(tmp_path.glob(".c.gguf*"))


def test_sidecar_is_one_unit_with_its_gguf(model, tmp_path):
    from mbolt.core.routemap import read_sidecar, sidecar_path

    src, shards = model
    a = reorder(src, tmp_path / "a.gguf", perm_for(moe_map(src), 1))
    b = reorder(src, tmp_path / "b.gguf", perm_for(moe_map(src), 2))
    read_sidecar(a.sidecar, moe_map(a.dst).fingerprint)
    shutil.copy(b.sidecar, a.sidecar)  # the other run's sidecar beside a's GGUF
    with pytest.raises(MboltError, match="stale sidecar"):
        read_sidecar(a.sidecar, moe_map(a.dst).fingerprint)
    rep = verify(src, a.dst)
    assert next(c for c in rep.checks if c.name == "sidecar").ok is False
    # a set's sidecar lies beside shard 1 and names every shard
    s = reorder(shards[0], tmp_path / "s.gguf", None)
    assert s.sidecar == str(sidecar_path(s.files[0]))
    import json

    d = json.loads(open(s.sidecar).read())
    assert d["files"] == [p.split("/")[-1] for p in s.files] and d["fingerprint"] == moe_map(s.files[1]).fingerprint


def test_expert_readers_on_a_set_read_the_files_bytes(model, tmp_path):
    from mbolt.reference.source import MmapExpertSource
    from mbolt.runtime.store import ExpertStore

    src, shards = model
    one, many = moe_map(src), moe_map(shards[2])
    ids = list(range(one.n_experts))
    for layout in ("reorder", "packed"):
        out = reorder(many, tmp_path / f"{layout}.gguf", perm_for(many, 8), layout=layout)
        om = moe_map(out.files[0])
        a = MmapExpertSource(one)
        readers = [MmapExpertSource(om), ExpertStore(out.files[0], mm=om, gap=4096),
                   ExpertStore(out.files[1], mode="os")]
        for layer in one.moe_layers:
            want = a.fetch(layer.index, ids)
            for r in readers:
                got = r.fetch(layer.index, ids)
                for e in ids:
                    for role, b in want[e].items():
                        assert got[e][role].tobytes() == b.tobytes(), (layout, layer.index, e, role, type(r))
        for r in readers + [a]:
            r.close()


def test_reference_engine_on_a_set_is_the_engine_on_the_file(model):
    from mbolt.reference import load_model

    src, shards = model
    ids = [3, 1, 4, 1, 5]
    a, b = load_model(src), load_model(shards[1])
    try:
        np.testing.assert_array_equal(a.forward(ids), b.forward(ids))
    finally:
        a.close()
        b.close()


def test_ab_replay_on_sets(model, tmp_path):
    from mbolt.bench.ab import run_ab
    from mbolt.bench.arms import Arm
    from mbolt.core.trace import DECODE, Trace

    _, shards = model
    m = moe_map(shards[0])
    out = reorder(m, tmp_path / "p.gguf", perm_for(m, 9), layout="packed")
    rng = np.random.default_rng(0)
    n = 8
    ex = np.stack([np.stack([rng.choice(m.n_experts, m.n_used, replace=False) for _ in range(m.n_layers)])
                   for _ in range(n)]).astype(np.int16)
    tr = Trace(m.n_layers, m.n_experts, m.n_used, ex, np.full(n, DECODE, np.uint8), np.zeros(n, np.int32),
               np.arange(n, dtype=np.int32), fingerprint=m.source_fingerprint)
    res = run_ab([Arm("stock", str(shards[1])), Arm("packed", out.files[2])], trace=tr, rounds=1, aa=False)
    assert len(res.rounds) == 2
    want = n * m.n_used * sum(layer.expert_bytes for layer in m.moe_layers)
    assert [r.useful_bytes for r in res.rounds] == [want, want]
    stock, packed = sorted(res.rounds, key=lambda r: r.arm != "stock")
    assert packed.reads < stock.reads  # one read per expert in the packed set, three in the stock set


def test_verify_of_another_geometry_is_a_usage_error_not_a_crash(model, tmp_path):
    """Not one model and its rewrite: exit 2 with one line (exit 1 is for a rewrite that differs)."""
    src, _ = model
    other = write_synth(tmp_path / "o.gguf", SynthConfig(arch="qwen3moe", n_layers=4, n_experts=16, n_used=2, seed=3))
    out = reorder(other, tmp_path / "o2.gguf", None)
    res = cli("verify", src, out.dst, "--no-parity")
    text = res.output.replace("\n", " ")
    assert res.exit_code == 2 and "not a rewrite of" in text and "4 layers x 16 experts" in text
    assert "Traceback" not in res.output


def test_reorder_never_replaces_the_model_a_trace_was_recorded_on(model, tmp_path):
    from mbolt.core.mbtrace import write_trace
    from mbolt.core.trace import DECODE, Trace

    src, _ = model
    stock = tmp_path / "stock.gguf"
    shutil.copy(src, stock)
    other = reorder(src, tmp_path / "other.gguf", None)  # some model file mbolt wrote
    m = moe_map(stock)
    n = 16
    rng = np.random.default_rng(0)
    ex = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(m.n_layers)]) for _ in range(n)])
    # a trace recorded on other.gguf, used to reorder stock.gguf into other.gguf
    tr = Trace(m.n_layers, 8, 2, ex.astype(np.int16), np.full(n, DECODE, np.uint8), np.zeros(n, np.int32),
               np.arange(n, dtype=np.int32), fingerprint=moe_map(other.dst).fingerprint)
    write_trace(tmp_path / "t.mbtrace", tr)
    before = sha(other.dst)
    res = cli("reorder", stock, other.dst, "--trace", tmp_path / "t.mbtrace", "--force")
    assert res.exit_code == 2 and "model an input was made from" in res.output, res.output
    assert sha(other.dst) == before


def test_set_killed_during_its_renames_is_refused_then_removed(model, tmp_path):
    import subprocess
    import sys
    import textwrap

    _, shards = model
    m = moe_map(shards[0])
    old = reorder(m, tmp_path / "r.gguf", perm_for(m, 1))
    child = textwrap.dedent("""
        import os, signal, sys
        import numpy as np
        import mbolt.rewrite.reorder as R
        real = os.replace
        n = [0]
        def replace(a, b):
            real(a, b)
            n[0] += 1
            if n[0] == 2:  # the sidecar and shard 3 are in place: die (no handler runs)
                os.kill(os.getpid(), signal.SIGKILL)
        R.os.replace = replace
        rng = np.random.default_rng(2)
        R.reorder(sys.argv[1], sys.argv[2], np.stack([rng.permutation(8) for _ in range(4)]), force=True)
    """)
    p = subprocess.run([sys.executable, "-c", child, str(shards[0]), str(tmp_path / "r.gguf")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == -9, p.stderr
    for f in old.files:  # old shards 1-2 beside the new shard 3: refused, whichever is opened
        with pytest.raises(MboltError, match="another set"):
            moe_map(f)
    assert list(tmp_path.glob(".r.gguf.*.journal"))
    res = reorder(m, tmp_path / "r.gguf", perm_for(m, 3))  # the next run cleans up and writes
    assert sorted(set(res.files) & set(res.removed_stale)) == sorted(res.files)
    assert verify(shards[0], res.files[1]).ok
    assert not [q for q in tmp_path.iterdir() if q.name.startswith(".")]


def test_force_replaces_a_set_of_another_shard_count_as_a_whole(model, tmp_path):
    src, shards = model
    out = tmp_path / "o.gguf"
    three = reorder(shards[0], out, None)
    with pytest.raises(MboltError, match="output exists"):
        reorder(src, out, None, split=SplitSpec(max_tensors=30))  # a 2-shard set under the same name
    two = reorder(src, out, None, split=SplitSpec(max_tensors=30), force=True)
    assert len(two.files) == 2
    assert not any(map(lambda p: __import__("os").path.exists(p), three.files))
    assert sorted(q.name for q in tmp_path.iterdir()) == sorted(
        [p.split("/")[-1] for p in two.files] + [two.sidecar.split("/")[-1]])
    one = reorder(src, out, None, split=SplitSpec(no_split=True), force=True)
    assert sorted(q.name for q in tmp_path.iterdir()) == ["o.gguf", "o.gguf.mbolt.json"]
    assert verify(src, one.dst).ok
