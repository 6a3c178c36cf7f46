"""The runtime reads a layer's missed experts in the order llama.cpp's matmuls use them (gate, up,
down), whatever order the file holds the tensors in: llama.cpp's converter writes each block's
down before its gate and up, and reads issued in file order then make the gate's matmul wait
behind the down's bytes.

Observed from outside the runtime: a shim preloaded into the process (LD_PRELOAD) logs every
posix_fadvise(WILLNEED) the process makes, from the C filter and from Python alike; the test maps
each logged range to its layer and tensor with the file's own header."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import needs_llama
from mbolt.synth.synth import SynthConfig, write_synth

pytestmark = needs_llama

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static void note(int fd, off_t off, off_t len, int advice) {
    const char *log = getenv("FADVISE_LOG");
    if (log == NULL || advice != POSIX_FADV_WILLNEED) return;
    char p[64], path[1024];
    snprintf(p, sizeof p, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(p, path, sizeof path - 1);
    path[n > 0 ? n : 0] = 0;
    pthread_mutex_lock(&mu);
    FILE *f = fopen(log, "a");
    if (f) { fprintf(f, "%lld %lld %s\n", (long long) off, (long long) len, path); fclose(f); }
    pthread_mutex_unlock(&mu);
}
int posix_fadvise(int fd, off_t off, off_t len, int advice) {
    static int (*real)(int, off_t, off_t, int);
    if (!real) real = dlsym(RTLD_NEXT, "posix_fadvise");
    note(fd, off, len, advice);
    return real(fd, off, len, advice);
}
int posix_fadvise64(int fd, off_t off, off_t len, int advice) {
    static int (*real)(int, off_t, off_t, int);
    if (!real) real = dlsym(RTLD_NEXT, "posix_fadvise64");
    note(fd, off, len, advice);
    return real(fd, off, len, advice);
}
"""

RUN = r"""
import sys
from mbolt.runtime.driver import open_driver
path, native, use_order = sys.argv[1], sys.argv[2] == "c", sys.argv[3] == "use"
with open_driver(path, reads=True, qd=2, asynchronous=True, n_ctx=256, budget=2 << 30, native_misses=native,
                 use_order=use_order) as d:
    d.make_cold()
    b = d.arm.budget
    b.decode_slots = b.prefill_slots = 6
    d.arm._resize_cache(6)
    d.generate([list(range(30, 130))], 24, forced=16)
    print(d.arm.native_layers)
"""


@pytest.fixture(scope="module")
def converter_order(tmp_path_factory):
    """A toy whose blocks hold down, gate, up in that order (as llama.cpp's converter writes them)."""
    d = tmp_path_factory.mktemp("order")
    path = write_synth(d / "toy.gguf", SynthConfig(arch="qwen3moe", n_layers=4, n_experts=16, n_used=4, hidden=64,
                                                   expert_ff=64, n_heads=4, n_kv_heads=2, head_dim=16,
                                                   expert_type="F32", dense_type="F32", seed=3,
                                                   tensor_order="converter"))
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler: the runtime's own filter needs one too")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "shim.so"), "-x", "c", "-", "-ldl", "-pthread"],
                   input=SHIM, text=True, check=True)
    return path, d / "shim.so"


def _willneed_roles(path, shim, log, native: bool, use_order: bool = True) -> tuple[list[list[str]], int]:
    """Each run of consecutive WILLNEEDs on one layer's expert tensors: the roles in call order."""
    from mbolt.core.moe_map import moe_map

    env = dict(os.environ, LD_PRELOAD=str(shim), FADVISE_LOG=str(log))
    r = subprocess.run([sys.executable, "-c", RUN, str(path), "c" if native else "py", "use" if use_order else "file"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    native_layers = int(r.stdout.split()[-1])
    spans = [(t.data_offset, t.data_offset + t.nbytes, l.index, t.role) for l in moe_map(path).moe_layers
             for t in l.weights]
    runs: list[list[str]] = []
    last = None
    for line in log.read_text().splitlines():
        off, n, who = line.split(" ", 2)
        if os.path.realpath(who) != os.path.realpath(path):
            continue
        hit = [(layer, role) for a, b, layer, role in spans if a <= int(off) < b]
        if not hit:  # the dense weights
            continue
        layer, role = hit[0]
        if layer != last:
            runs.append([])
            last = layer
        runs[-1].append(role)
    return runs, native_layers


@pytest.mark.parametrize("native", [True, False], ids=["c", "python"])
def test_missed_experts_are_read_in_the_order_llama_cpp_uses_them(converter_order, tmp_path, native):
    path, shim = converter_order
    runs, native_layers = _willneed_roles(path, shim, tmp_path / "log.txt", native)
    assert (native_layers > 0) == native  # the path under test answered the layers with misses
    rank = {"gate": 0, "up": 1, "down": 2}
    full = [r for r in runs if {"gate", "down"} <= set(r)]
    assert len(full) > 24  # decode layers that read gate and down (not a vacuous pass)
    for r in runs:
        ranks = [rank[x] for x in r]
        assert ranks == sorted(ranks), r  # gate before up before down, never the file's down first


def test_the_ab_switch_reads_in_file_order(converter_order, tmp_path):
    """`mbolt ab`'s arm option `fileorder` (use_order=False), the other side of the A/B: the C filter
    then reads a layer's misses in the file's order, the down's first."""
    path, shim = converter_order
    runs, native_layers = _willneed_roles(path, shim, tmp_path / "log.txt", native=True, use_order=False)
    assert native_layers > 0
    full = [r for r in runs if {"gate", "down"} <= set(r)]
    assert len(full) > 24 and all(r.index("down") < r.index("gate") for r in full)
