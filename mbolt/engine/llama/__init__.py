"""llama.cpp as mbolt's runtime, through llama-cpp-python (no patch): `runner` loads a model and
context and reads each layer's expert selection from the eval callback; `stream` is the streaming
runtime (explicit expert reads, a memory budget, dense weights resident; the pages it controls:
engine.pages)."""
