"""jinfer: an LLM inference engine on JAX."""

__version__ = "0.1.0"

from jinfer.pooling_params import PoolingParams  # noqa: E402
from jinfer.sampling_params import SamplingParams  # noqa: E402
from jinfer.structured_outputs import GuidedDecodingParams, StructuredOutputsParams  # noqa: E402


def __getattr__(name):  # LLM pulls in JAX and the engine: import it lazily
    if name == "LLM":
        from jinfer.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics", "EmbeddingRequestOutput",
                "EmbeddingOutput"):
        from jinfer import outputs

        return getattr(outputs, name)
    raise AttributeError(name)


__all__ = ["LLM", "PoolingParams", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "__version__"]
