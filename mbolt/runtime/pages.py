"""An engine's pages of a model it maps (llama.cpp; the reference engine's dense weights): the
expert tensors' own pages in its mappings and the page cache (drop them, prove it), and the dense
weights (bring them back page by page, map them, lock them). `ExpertPages` covers one file or a split set (a `FilePages` per file)."""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.gguf_set import split_vaddr, vaddr
from mbolt.core.moe_map import MoeMap
from mbolt.core.pagecache import (MADV_DONTNEED, MADV_RANDOM, PAGE, expert_spans, file_mappings, inward, joined,
                                  libc, resident_share, residency_visible)
from mbolt.core.routemap import expert_ranges

RESET_CHUNK = 8 << 20  # bytes per read when the dense tensors are brought back
MREMAP_MAYMOVE, MREMAP_FIXED, MREMAP_DONTUNMAP = 1, 2, 4  # <linux/mman.h>
MAP_FIXED, MADV_HUGEPAGE, MADV_POPULATE_WRITE = 0x10, 14, 23


def _dense_spans(mm: MoeMap, experts: list[tuple[int, int]], file: int = 0) -> list[tuple[int, int]]:
    """Byte spans of every tensor of one file of the model that is not a routed expert tensor."""
    inside = set(experts)
    out = []
    for t in mm.header.tensors:
        if t.file != file:
            continue
        s = (int(t.data_offset), int(t.data_offset) + int(t.nbytes))
        if not any(a <= s[0] and s[1] <= b for a, b in inside):
            out.append(s)
    return out


def anonymous(size: int, huge: bool = True) -> int:
    """The address of `size` bytes of new anonymous memory, read-write, advised MADV_HUGEPAGE and
    populated (its pages allocated and zeroed now, not at first touch)."""
    lib = libc()
    addr = lib.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise MboltError(f"no anonymous memory for {size} B (errno {ctypes.get_errno()})")
    if huge:
        lib.madvise(ctypes.c_void_p(addr), size, MADV_HUGEPAGE)  # refused without THP: small pages then
    lib.madvise(ctypes.c_void_p(addr), size, MADV_POPULATE_WRITE)  # refused before Linux 5.14: faulted in later
    return addr


def move_pages(src: int, dst: int, size: int) -> None:
    """Move the anonymous pages of [src, src + size) over dst (mremap: page tables move, no byte is
    copied; what was mapped at dst goes). Neither range is ever unmapped (MREMAP_DONTUNMAP leaves src
    mapped, empty): a hole could be taken by any allocation of another thread and then clobbered."""
    lib = libc()
    flags = MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP
    if lib.mremap(ctypes.c_void_p(src), size, size, flags, ctypes.c_void_p(dst)) != dst:
        raise MboltError(f"could not move {size} B of memory to {dst:#x} (errno {ctypes.get_errno()})")


def can_move_pages() -> bool:
    """Whether this kernel moves pages with MREMAP_DONTUNMAP (Linux 5.7)."""
    try:
        a, b = anonymous(PAGE, huge=False), anonymous(PAGE, huge=False)
    except MboltError:
        return False
    try:
        move_pages(a, b, PAGE)
        return True
    except MboltError:
        return False
    finally:
        libc().munmap(ctypes.c_void_p(a), PAGE)
        libc().munmap(ctypes.c_void_p(b), PAGE)


class FilePages:
    """The expert tensors' own pages of one file of a model (a shard of a split set, or the one
    file), in this process's mappings and the page cache. Offsets are the file's own."""

    def __init__(self, mm: MoeMap, file: int = 0, before_load: bool = False):
        self.path = mm.paths[file]
        spans = expert_spans(mm, file)
        self.spans = inward(joined(spans))
        self.dense_tensors = _dense_spans(mm, spans, file)  # whole tensors: every page with a dense byte
        self.dense_spans = inward(self.dense_tensors)
        # every page holding a dense byte (a gap under a page between two tensors holds no whole page)
        self.dense_pages = [(a // PAGE * PAGE, -(-b // PAGE) * PAGE) for a, b in joined(self.dense_tensors)]
        # made before the engine loads the file: the maps of it this process holds already (gguf-py's
        # reader, say) are not the engine's, never advised, locked or dropped (a lock left on one
        # made the next model's reset fail: madvise EINVAL)
        self.foreign = {(lo, hi) for lo, hi, _ in file_mappings(self.path)} if before_load else set()
        self.fd = os.open(self.path, os.O_RDONLY)
        self.residency_visible = residency_visible(self.path)
        self._probe: tuple[int, int] | None = None  # (address, size) of the mincore mapping
        self._vec = (ctypes.c_ubyte * 0)()
        self.maps: list[tuple[int, int, int]] = []
        self.overlaid: list[tuple[int, int]] = []  # file spans whose mapped pages are anonymous copies
        self.lib = libc()

    def attach(self) -> None:
        """Find the engine's mappings of the file (call after the engine mapped it)."""
        self.maps = [m for m in file_mappings(self.path) if m[:2] not in self.foreign]
        if not self.maps:
            raise MboltError(f"{self.path}: the engine did not map the file (llama.cpp: load mode mmap expected)")

    def _addresses(self, a: int, b: int):
        """(address, bytes, file offset) of each mapped piece of the file span [a, b)."""
        for lo, hi, off in self.maps:
            x, y = max(a, off), min(b, off + hi - lo)
            if y > x:
                yield lo + x - off, y - x, x

    def drop(self, spans=None) -> None:
        """Unmap the pages from every mapping of the file, then drop them from the page cache."""
        for a, b in self.spans if spans is None else spans:
            for addr, n, _ in self._addresses(a, b):
                if self.lib.madvise(ctypes.c_void_p(addr), n, MADV_DONTNEED) != 0:
                    raise MboltError(f"{self.path}: madvise(MADV_DONTNEED) failed (errno {ctypes.get_errno()})")
            os.posix_fadvise(self.fd, a, b - a, os.POSIX_FADV_DONTNEED)

    def _advise(self, advice: int) -> None:
        for lo, hi, _ in self.maps:
            if self.lib.madvise(ctypes.c_void_p(lo), hi - lo, advice) != 0:
                raise MboltError(f"{self.path}: madvise({advice}) failed (errno {ctypes.get_errno()})")

    def reset(self) -> None:
        """Every page of the file out of the mapping and the page cache, then the dense tensors back
        as single 4 KiB pages. Why: llama.cpp's load reads the whole file into large folios, which
        straddle the dense/expert boundaries and survive any drop of the expert spans alone. The
        dense pages come back through a descriptor with POSIX_FADV_RANDOM (no readahead: the page
        cache fills exactly the pages asked for, one page per folio), so dense and expert pages
        never share a folio again: dropping the expert spans then leaves none of them resident
        and the dense weights resident (llama.cpp maps them back with minor faults)."""
        if self.overlaid:
            # the dense weights live in anonymous memory now (an advice over them would zero them):
            # only the expert pages go
            self.drop()
            return
        self._advise(MADV_DONTNEED)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            buf = bytearray(RESET_CHUNK)
            for a, b in self.dense_pages:
                while a < b:
                    n = os.preadv(fd, [memoryview(buf)[:min(RESET_CHUNK, b - a)]], a)
                    if n <= 0:
                        break
                    a += n
        finally:
            os.close(fd)

    def map_dense(self) -> None:
        """Touch every dense page through each mapping (after `reset`): minor faults put them in the
        page tables, and a mapped page survives any page-cache drop, so no drop of expert pages
        (whole 2 MiB blocks) can take a dense page the engine has not used yet."""
        sink = 0
        for a, b in self.dense_pages:
            for addr, n, _ in self._addresses(a, b):
                sink += int(np.ctypeslib.as_array((ctypes.c_ubyte * n).from_address(addr))[::PAGE].sum())

    def hold_dense(self, lockable: int | None) -> tuple[int, int]:
        """Keep every page holding a dense byte resident, so the kernel cannot reclaim a dense
        weight under a memory limit (each such page came back through a fault whose readahead read
        experts around it: about 300 major faults per token, issue 19). Up to `lockable` bytes (None:
        no limit known, try them all) are mlocked; what mlock refuses (RLIMIT_MEMLOCK is 8 MiB for
        an ordinary user, who has no CAP_IPC_LOCK) is copied into anonymous memory laid over the
        same addresses (mremap onto llama.cpp's mapping: the tensors' addresses do not change; the
        kernel cannot drop anonymous pages without swap) and its file pages dropped from the page
        cache. Pages shared with an expert tensor come along; no overlaid page is ever advised
        MADV_DONTNEED again (it would read back as zeros). Returns (bytes locked, bytes copied)."""
        locked = copied = 0
        for a, b in self.dense_pages:
            for addr, size, _ in self._addresses(a, b):
                n = size if lockable is None else max(0, min(size, lockable - locked)) // PAGE * PAGE
                if n and self.lib.mlock(ctypes.c_void_p(addr), n) == 0:
                    locked += n
                else:
                    n = 0
                    lockable = locked  # refused (the limit, or no privilege): the rest is copied
                if n < size:
                    self._overlay(addr + n, size - n)
                    copied += size - n
        return locked, copied

    def _overlay(self, addr: int, size: int) -> None:
        """Replace [addr, addr + size) of the file mapping by an anonymous copy of its bytes."""
        lib = self.lib
        new = lib.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if new in (None, ctypes.c_void_p(-1).value):
            raise MboltError(f"{self.path}: no anonymous memory for {size} B of dense weights (errno {ctypes.get_errno()})")
        ctypes.memmove(new, addr, size)
        if lib.mprotect(ctypes.c_void_p(new), size, mmap.PROT_READ) != 0 or lib.mremap(
                ctypes.c_void_p(new), size, size, MREMAP_MAYMOVE | MREMAP_FIXED, ctypes.c_void_p(addr)) != addr:
            err = ctypes.get_errno()
            lib.munmap(ctypes.c_void_p(new), size)
            raise MboltError(f"{self.path}: could not lay {size} B of dense weights over the mapping (errno {err})")
        lo = next(off + addr - m_lo for m_lo, m_hi, off in self.maps if m_lo <= addr < m_hi)
        self.overlaid.append((lo, lo + size))
        os.posix_fadvise(self.fd, lo, size, os.POSIX_FADV_DONTNEED)  # the file's copy is no longer mapped

    def map_file(self, a: int, b: int) -> None:
        """The file back in the mappings over [a, b) (after anonymous pages were moved over it and
        away again: `move_pages`), as llama.cpp maps it (read-only, shared) and advised MADV_RANDOM
        like every expert span under a budget."""
        lib = self.lib
        for addr, n, off in self._addresses(a, b):
            got = lib.mmap(ctypes.c_void_p(addr), n, mmap.PROT_READ, MAP_FIXED | mmap.MAP_SHARED, self.fd, off)
            if got != addr or lib.madvise(ctypes.c_void_p(addr), n, MADV_RANDOM) != 0:
                raise MboltError(f"{self.path}: could not map the file back over the mapping at byte {off} "
                                 f"(errno {ctypes.get_errno()})")

    def advise_experts(self, advice: int = MADV_RANDOM) -> None:
        """madvise the expert spans of the engine's mappings (MADV_RANDOM: a fault reads its one page,
        not the device's readahead window around it)."""
        for a, b in self.spans:
            for addr, n, _ in self._addresses(a, b):
                if self.lib.madvise(ctypes.c_void_p(addr), n, advice) != 0:
                    raise MboltError(f"{self.path}: madvise({advice}) failed (errno {ctypes.get_errno()})")

    def pages(self, spans) -> int:
        return sum(max(0, (b - a) // PAGE) for a, b in spans)

    def resident(self, spans=None) -> float:
        """Share of the pages of `spans` (default: the expert spans) in the page cache (mincore)."""
        return resident_share(self.path, self.spans if spans is None else spans)

    def mapped(self, spans=None) -> float:
        """Share of the pages of `spans` present in this process's page tables (/proc/self/pagemap)."""
        spans = self.spans if spans is None else spans
        present = total = 0
        with open("/proc/self/pagemap", "rb") as f:
            for a, b in spans:
                for addr, n, _ in self._addresses(a, b):
                    f.seek(addr // PAGE * 8)
                    v = np.frombuffer(f.read(n // PAGE * 8), dtype=np.uint64)
                    present += int(((v >> np.uint64(63)) & np.uint64(1)).sum())
                    total += v.size
        return present / total if total else 0.0

    def all_resident(self, spans) -> bool:
        """Whether every page of `spans` is in the page cache (mincore on a mapping of the file that
        is never touched, kept open for these checks: a few microseconds per span). On a file whose
        residency the kernel hides from this process, True without asking (it would say so)."""
        if not self.residency_visible:
            return True
        if self._probe is None:
            size = os.fstat(self.fd).st_size
            addr = self.lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, self.fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise MboltError(f"{self.path}: mmap for mincore failed (errno {ctypes.get_errno()})")
            self._probe = (addr, size)
        addr, size = self._probe
        for a, b in spans:
            a, b = a // PAGE * PAGE, min(-(-b // PAGE) * PAGE, size)
            n = (b - a) // PAGE
            if n <= 0:
                continue
            if len(self._vec) < n:
                self._vec = (ctypes.c_ubyte * n)()
            if self.lib.mincore(ctypes.c_void_p(addr + a), b - a, self._vec) != 0:
                raise MboltError(f"{self.path}: mincore failed (errno {ctypes.get_errno()})")
            if not (np.frombuffer(self._vec, np.uint8, n) & 1).all():
                return False
        return True

    def close(self) -> None:
        if self._probe is not None:
            self.lib.munmap(ctypes.c_void_p(self._probe[0]), self._probe[1])
            self._probe = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ExpertPages:
    """The expert tensors' own pages of a model, one file or a split set (a `FilePages` per file),
    in this process's mappings and the page cache. Spans are the model's virtual offsets
    (`core.gguf_set`: file << 48 | offset; a one-file model's are its file offsets)."""

    def __init__(self, path: str, mm: MoeMap, before_load: bool = False):
        """`before_load`: made before the engine maps the files (see FilePages)."""
        self.path = str(path)
        self.mm = mm
        self.files: list[FilePages] = []
        try:
            for f in range(len(mm.paths)):
                self.files.append(FilePages(mm, f, before_load))
        except BaseException:
            self.close()
            raise
        self._ranges: dict[int, np.ndarray] = {}  # layer -> expert_ranges (the one computation per layer)
        self.residency_hidden = [fp.path for fp in self.files if not fp.residency_visible]  # files mincore lies about
        self.spans = self._virtual("spans")
        self.dense_tensors = self._virtual("dense_tensors")
        self.dense_spans = self._virtual("dense_spans")

    def _virtual(self, name: str) -> list[tuple[int, int]]:
        return [(vaddr(f, a), vaddr(f, b)) for f, fp in enumerate(self.files) for a, b in getattr(fp, name)]

    def dense_bytes(self) -> int:
        """Bytes of the pages that hold a dense weight (what the runtime keeps resident)."""
        return sum(b - a for fp in self.files for a, b in fp.dense_pages)

    def _by_file(self, spans) -> dict[int, list[tuple[int, int]]]:
        out: dict[int, list[tuple[int, int]]] = {}
        for a, b in spans:
            (f, x), (_, y) = split_vaddr(a), split_vaddr(b)
            out.setdefault(f, []).append((x, y))
        return out

    def attach(self) -> None:
        for fp in self.files:
            fp.attach()

    def drop(self, spans=None) -> None:
        """Unmap the pages from every mapping of the model's files, then drop them from the page cache."""
        for f, sp in ([(f, None) for f in range(len(self.files))] if spans is None else self._by_file(spans).items()):
            self.files[f].drop(sp)

    def reset(self) -> None:
        for fp in self.files:
            fp.reset()

    def map_dense(self) -> None:
        for fp in self.files:
            fp.map_dense()

    def hold_dense(self, lockable: int | None) -> tuple[int, int]:
        locked = copied = 0
        for fp in self.files:
            a, b = fp.hold_dense(None if lockable is None else lockable - locked)
            locked, copied = locked + a, copied + b
        return locked, copied

    def mapped_pieces(self, spans) -> list[tuple[int, int, int, int]]:
        """(file, address, bytes, file offset) of each mapped piece of these virtual spans."""
        return [(f, *piece) for f, sp in self._by_file(spans).items() for a, b in sp
                for piece in self.files[f]._addresses(a, b)]

    def map_file(self, f: int, a: int, b: int) -> None:
        self.files[f].map_file(a, b)

    def advise_experts(self, advice: int = MADV_RANDOM) -> None:
        for fp in self.files:
            fp.advise_experts(advice)

    def layer_ranges(self, layer: int) -> np.ndarray:
        """core.routemap.expert_ranges of one layer (int64 [E, roles, 2]: virtual start, length), computed once."""
        R = self._ranges.get(layer)
        if R is None:
            R = self._ranges[layer] = expert_ranges(self.mm, layer)
        return R

    def slice_table(self, n_layers: int) -> np.ndarray:
        """int64 [layers, E, roles, 3]: (file, offset, length) of every expert slice (the C filter's
        reads), the roles in llama.cpp's use order (the filter reads them in that order)."""
        roles = max((len(l.weights) for l in self.mm.moe_layers), default=0)
        out = np.zeros((n_layers, self.mm.n_experts, roles, 3), np.int64)
        for l in self.mm.moe_layers:
            R = self.layer_ranges(l.index)[:, [c for cols in l.tensor_columns() for c in cols]]  # [E, roles, 2]
            out[l.index, :, : R.shape[1], 0], out[l.index, :, : R.shape[1], 1] = split_vaddr(R[..., 0])
            out[l.index, :, : R.shape[1], 2] = R[..., 1]
        return out

    def single_maps(self) -> list[tuple[int, int, int]] | None:
        """(address, file offset, length) of each file's one mapping; None when a file is mapped more than once."""
        if any(len(fp.maps) != 1 for fp in self.files):
            return None
        return [(lo, off, hi - lo) for fp in self.files for lo, hi, off in fp.maps]

    def expert_resident(self, layer: int, expert: int) -> bool:
        """Every page of one expert's slices (original id) is in the page cache."""
        R = self.layer_ranges(layer)[int(expert)]
        for f, spans in self._by_file((int(s), int(s + n)) for s, n in R).items():
            if not self.files[f].all_resident(spans):
                return False
        return True

    def expert_spans_of(self, layer: int, experts) -> list[tuple[int, int]]:
        """Whole pages inside the slices of these experts (original ids) of one layer; slices that
        touch are joined first (a page two of them share goes too; no dense byte lies between
        touching slices)."""
        R = self.layer_ranges(layer)[np.asarray(list(experts), np.int64)].reshape(-1, 2)
        return inward(joined(zip(R[:, 0].tolist(), (R[:, 0] + R[:, 1]).tolist()), gap=0))

    def _share(self, what: str, spans) -> float:
        groups = ({f: None for f in range(len(self.files))} if spans is None else self._by_file(spans))
        num = den = 0.0
        for f, sp in groups.items():
            fp = self.files[f]
            n = fp.pages(fp.spans if sp is None else sp)
            if n:
                num += getattr(fp, what)(sp) * n
                den += n
        return num / den if den else 0.0

    def resident(self, spans=None) -> float:
        """Share of the pages of `spans` (default: the expert spans) in the page cache (mincore)."""
        return self._share("resident", spans)

    def mapped(self, spans=None) -> float:
        """Share of the pages of `spans` present in this process's page tables (/proc/self/pagemap)."""
        return self._share("mapped", spans)

    def close(self) -> None:
        for fp in self.files:
            fp.close()
