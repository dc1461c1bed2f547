"""One mapping per model file and process, and releasing its pages (parity/gguf/mapping.py, Weights.release, the
reference's weight store). Checked against the kernel's own accounts: /proc/self/maps (which mappings exist) and
/proc/self/pagemap (which of a mapping's pages are present in the process)."""

from __future__ import annotations

import gc
import os
import shutil
import struct
from pathlib import Path

import numpy as np

from parity.gguf.container import GGUFFile
from parity.gguf.mapping import file_map
from parity.gguf.weights import Weights
from reference_cpu.weights_cache import WeightStore

PAGE = os.sysconf("SC_PAGE_SIZE")


def mappings(path: Path) -> list[tuple[int, int, int]]:
    """(start address, end address, file offset) of each mapping of `path` in this process."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            span, _, offset = line.split()[:3]
            start, end = (int(x, 16) for x in span.split("-"))
            out.append((start, end, int(offset, 16)))
    return out


def present_pages(path: Path) -> set[int]:
    """The file pages (byte offset // PAGE) of the process's one mapping of `path` that are present in memory."""
    [(start, end, offset)] = mappings(path)
    with open("/proc/self/pagemap", "rb") as pm:
        pm.seek(start // PAGE * 8)
        entries = pm.read((end - start) // PAGE * 8)
    return {offset // PAGE + i for i, (e,) in enumerate(struct.iter_unpack("<Q", entries)) if e >> 63 & 1}


def pages(start: int, stop: int) -> set[int]:
    """The pages that hold bytes [start, stop)."""
    return set(range(start // PAGE, -(-stop // PAGE)))


def test_every_reader_of_a_file_shares_one_mapping(tiny_realmix, tmp_path):
    path = tmp_path / "copy.gguf"   # a file no other test's reader holds open
    shutil.copyfile(tiny_realmix, path)
    readers = [Weights(path), Weights(path), GGUFFile(path)]
    assert len(mappings(path)) == 1
    name = "blk.0.ffn_down_exps.weight"
    assert np.array_equal(readers[0].raw(name), readers[1].raw(name))
    del readers
    gc.collect()
    assert mappings(path) == []


def test_release_drops_exactly_the_pages_of_the_range_and_the_bytes_read_back(tmp_path):
    path = tmp_path / "blob.bin"
    data = np.random.default_rng(0).integers(0, 256, 64 * PAGE, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    fm = file_map(str(path))
    assert int(fm.array.sum()) == int(data.sum())   # every page touched
    assert present_pages(path) == pages(0, data.size)
    start, stop = 10 * PAGE + 100, 40 * PAGE + 5
    fm.release(start, stop)
    assert present_pages(path) == pages(0, data.size) - pages(start, stop)
    assert np.array_equal(fm.array, data)


def test_a_file_rewritten_in_place_reads_its_new_bytes_and_a_replaced_one_gets_its_own_mapping(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(b"a" * PAGE)
    first = file_map(str(path))
    with open(path, "r+b") as f:   # same inode, same size: the shared mapping shows the new bytes
        f.write(b"b" * PAGE)
    assert file_map(str(path)) is first and bytes(first.array[:3]) == b"bbb"
    replacement = tmp_path / "new.bin"
    replacement.write_bytes(b"c" * PAGE)
    os.replace(replacement, path)   # another inode at the path: a mapping of its own, the old one unchanged
    second = file_map(str(path))
    assert second is not first and bytes(second.array[:3]) == b"ccc" and bytes(first.array[:3]) == b"bbb"


def test_the_reference_store_releases_the_raw_bytes_it_decoded(tiny_realmix):
    path = Path(tiny_realmix).resolve()
    weights = Weights(path)
    store = WeightStore(weights, np.dtype(np.float32), 1.0, "none")
    gguf = weights.files[0]
    name, dense = "blk.2.ffn_down_exps.weight", "blk.2.attn_compressor_kv.weight"   # Q2_K experts, F16
    experts, d = gguf.tensors[name], gguf.tensors[dense]
    per = experts.nbytes // experts.shape[0]
    int(weights.raw(name).sum()) + int(weights.raw(dense).sum())   # every page of both tensors present
    before = present_pages(path)
    assert pages(experts.offset, experts.offset + experts.nbytes) | pages(d.offset, d.offset + d.nbytes) <= before
    gguf.release(weights.raw(name).copy())   # not a view of the file (a drafter's split tensor): nothing to drop
    assert present_pages(path) == before
    store.expert(name, 3)
    store.dense(dense)
    gone = before - present_pages(path)
    e3 = (experts.offset + 3 * per, experts.offset + 4 * per)
    assert gone == pages(*e3) | pages(d.offset, d.offset + d.nbytes)
