"""The llama.cpp streaming runtime, through llama-cpp-python (no patch).

binding   the ties to one llama-cpp-python release (ctypes layouts, log text, private names)
runner    one llama.cpp model and context; the eval callback that reads each layer's selection
memory    what llama.cpp allocates for a context (KV cache, compute buffer), planned before a load
budget    the memory budget: planned before the load, enforced after it (one object)
pages     the expert and dense pages of llama.cpp's mapping (drop, prove, hold)
store     explicit merged reads of experts and the per-layer slot cache
prefill   long background reads of a prompt pass's experts
streamer  what mbolt does at each layer's expert selection (the step kinds, reads and drops)
driver    the one decode driver: prompts, decode steps, sequences (generate, chat, serve, trace, bench)
"""
