"""speculant: exact speculative decoding for local LLMs on PyTorch.

    from speculant import Engine, GenerationConfig, load_model
    engine = Engine(load_model("qwen2.5-coder-1.5b-instruct"), load_model("qwen2.5-coder-0.5b-instruct", draft=True))
    for chunk in engine.stream("def quicksort(xs):"):
        ...
"""

from .decoding.engine import Chunk, Done, Engine, GenerationConfig
from .methods.config import MethodConfig, drafter_method
from .errors import SpeculantError
from .models import LoadedModel, load_model
from .exact.sampler import SamplingConfig

__all__ = ["Chunk", "Done", "Engine", "GenerationConfig", "LoadedModel", "MethodConfig", "SamplingConfig", "drafter_method",
           "SpeculantError", "load_model"]
__version__ = "0.1.0"
