"""Generation: many tenants' fine-tuned decoders (GPT-2, BART, Marian) in one running batch.

``api`` holds the plain request/result types; the engine, the decoder forward, the KV cache and
the search live in the modules beside it (see docs/architecture.md, "Generation").
"""

from itif.generation.api import GenerateRequest, Generation, GenerationDefaults, check_request

__all__ = ["GenerateRequest", "Generation", "GenerationDefaults", "check_request"]
