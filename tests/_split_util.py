"""Split sets written by gguf-py's own split writer (as `gguf-split` does), never by mbolt's code."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter


def split_with_gguf_py(src, out, *, max_tensors: int = 0, max_size: int = 0) -> list[Path]:
    """Rewrite `src` as a split set `out` -> out-0000I-of-0000N.gguf with GGUFWriter's splitter;
    returns the shard paths in order."""
    r = GGUFReader(str(src))
    arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")
    w = GGUFWriter(str(out), arch, split_max_tensors=max_tensors, split_max_size=max_size)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        if name == "general.alignment":
            w.data_alignment = int(f.parts[-1][0])
        if vtype == GGUFValueType.ARRAY:
            sub = f.types[-1]
            if sub == GGUFValueType.STRING:
                val = [str(bytes(f.parts[i]), "utf-8") for i in f.data]
            else:
                val = [f.parts[i][0].item() for i in f.data]
            w.add_key_value(name, val, vtype, sub_type=sub)
        elif vtype == GGUFValueType.STRING:
            w.add_key_value(name, str(bytes(f.parts[-1]), "utf-8"), vtype)
        else:
            w.add_key_value(name, f.parts[-1][0].item(), vtype)
    for t in r.tensors:
        data = np.asarray(t.data)
        w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    n = len(w.tensors)
    out = Path(out)
    if n == 1:
        return [out]
    return [out.with_name(f"{out.stem}-{i + 1:05d}-of-{n:05d}.gguf") for i in range(n)]
