"""One module per architecture family; each is a small subclass of reference.model.Model.
`load_model` opens a file as the class of its `general.architecture`."""

from __future__ import annotations

import os
from pathlib import Path

from gguf import Keys

from mbolt.core.errors import MboltError
from mbolt.core.gguf_set import open_model_header
from mbolt.core.moe_map import MoeMap, moe_map

from mbolt.reference.arch.glm4moe import Glm4MoE
from mbolt.reference.arch.mixtral import Mixtral
from mbolt.reference.arch.olmoe import OLMoE
from mbolt.reference.arch.qwen2moe import Qwen2MoE
from mbolt.reference.arch.qwen3moe import Qwen3MoE
from mbolt.reference.model import HParams, Model

# general.architecture -> model class ("llama" with expert tensors is how Mixtral ships)
ARCHS = {
    "qwen3moe": Qwen3MoE,
    "olmoe": OLMoE,
    "qwen2moe": Qwen2MoE,
    "llama": Mixtral,
    "mixtral": Mixtral,
    "glm4moe": Glm4MoE,
}


def load_model(path: str | os.PathLike | MoeMap, *, route: str = "file", expert_source=None) -> Model:
    """Open a MoE GGUF (one file or any shard of a split set; or the model already opened as a
    MoeMap, not read again) for the reference engine (see the module docstring for `route`)."""
    if route not in ("file", "map"):
        raise MboltError(f"route must be 'file' or 'map', not {route!r}")
    opened = path if isinstance(path, MoeMap) else None
    path = Path(opened.path if opened else path)
    header = opened.header if opened else open_model_header(path)  # one file, or the whole set of a shard
    arch = header.get(Keys.General.ARCHITECTURE)
    cls = ARCHS.get(arch)
    if cls is None:
        raise MboltError(f"{path}: architecture {arch!r} is not supported by the reference engine "
                         f"(supported: {', '.join(sorted(ARCHS))}; `mbolt trace --engine llama.cpp` "
                         f"traces any architecture llama.cpp runs)")
    mm = opened or moe_map(header)
    tok = header.get(Keys.Tokenizer.LIST)
    emb = header.tensor("token_embd.weight")
    if emb is None:
        raise MboltError(f"{path}: missing tensor token_embd.weight")
    n_vocab = int(emb.ne[1]) if len(emb.ne) > 1 else len(tok or [])
    hp = HParams.from_header(header, mm.numbers, n_vocab)
    routes = mm.route_map
    return cls(path, header, mm, hp, routes, route, expert_source)
