"""One module per architecture family; each is a small subclass of engine.model.Model."""

from mbolt.engine.arch.glm4moe import Glm4MoE
from mbolt.engine.arch.mixtral import Mixtral
from mbolt.engine.arch.olmoe import OLMoE
from mbolt.engine.arch.qwen2moe import Qwen2MoE
from mbolt.engine.arch.qwen3moe import Qwen3MoE

# general.architecture -> model class ("llama" with expert tensors is how Mixtral ships)
ARCHS = {
    "qwen3moe": Qwen3MoE,
    "olmoe": OLMoE,
    "qwen2moe": Qwen2MoE,
    "llama": Mixtral,
    "mixtral": Mixtral,
    "glm4moe": Glm4MoE,
}
