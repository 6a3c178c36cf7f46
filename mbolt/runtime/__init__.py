"""The llama.cpp streaming runtime, through llama-cpp-python (no patch).

binding   the ties to one llama-cpp-python release (ctypes layouts, log text, private names)
runner    one llama.cpp model and context; the eval callback that reads each layer's selection
native    the eval callback's filter in C (native.c, drops.c): a decode layer answered without Python
memory    what llama.cpp allocates for a context (KV cache, compute buffer), planned before a load
budget    the memory budget: planned before the load, enforced after it (one object)
pages     the expert and dense pages of llama.cpp's mapping (drop, prove, hold)
store     explicit merged reads of experts and the per-layer slot cache
prefill   long background reads of a prompt pass's experts
arm       what both arms share (the streamable check, prompt counters, this process's memory)
streamer  the streaming arm: what mbolt does at each layer's expert selection (reads and drops)
plain     the plain arm: llama.cpp with the file mapped, what the runtime is measured against
kernel_load    a kernel-layout file (mbolt repack) into llama.cpp's own buffers, nothing repacked
rows           a kernel-layout file's experts as rows of those buffers: where, read in, given back
kernel_stream  the streaming arm over a kernel-layout file (reads into rows, the same budget and rule)
cache_view     what a server shows of either streaming arm (counters, budget, cache map): one shape
sampling  llama.cpp's sampler chain (grammar, penalties, top-k/p, min-p, temperature)
driver    the decode driver: prompts, decode steps, sequences, and the measured generate loop
measured  what that loop records (StreamRun) and the decode routing it saw, as a Trace
"""
