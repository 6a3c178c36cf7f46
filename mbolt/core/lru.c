/* The one expert cache rule, written once (core/lru.py says what it means for `--cache-slots`).
   Two bindings call it: core.lru.ArrayLru through ctypes (a thin Python view over the same arrays;
   its pure-Python body is only the fallback where no C compiler exists) and the runtime's C filter
   (runtime/native.c: all_cached and with_misses), which is compiled with this file.

   One layer's slot cache over integer keys 0..n_keys-1, its state in the caller's arrays:
   cached[e] (in the cache), stamp[e] (its last use, from the shared *clock), *count (the cached
   keys) and pinned[e] (never leaves once admitted; NULL: no pins). */
#include "lru.h"

/* the rule's first half: every key used in order (stamped ++clock, so the last key is the most
   recently used, a repeated key counting at its last use) and in the cache; returns how many
   entered (the caller adds them to its count) */
int64_t mbolt_lru_use(uint8_t * cached, int64_t * stamp, int64_t * clock, const int64_t * keys, int64_t n) {
    int64_t entered = 0;
    for (int64_t i = 0; i < n; i++) {
        stamp[keys[i]] = ++*clock;
        if (!cached[keys[i]]) {
            cached[keys[i]] = 1;
            entered++;
        }
    }
    return entered;
}

/* A step's keys become the most recently used, in order; then the least recently used unpinned
   keys beyond `slots` leave (a step's own keys too when it brings more than the slots: k > N
   keeps the last N requested). The victims go to `victims` (room for n_keys), least recently used
   first; returns how many, or -1 (nothing changed) when a key is outside 0..n_keys-1. Slots <= 0:
   no cache, nothing changes. A union of pins larger than the slots stays: the cache is over by
   that much. */
int64_t mbolt_lru_admit(uint8_t * cached, int64_t * stamp, int64_t n_keys, int64_t * clock, int64_t * count,
                        int64_t slots, const uint8_t * pinned, const int64_t * keys, int64_t n, int32_t * victims) {
    for (int64_t i = 0; i < n; i++) {
        if (keys[i] < 0 || keys[i] >= n_keys) {
            return -1;
        }
    }
    if (slots <= 0) {
        return 0;
    }
    *count += mbolt_lru_use(cached, stamp, clock, keys, n);
    int64_t n_victims = 0;
    while (*count > slots) {
        int64_t v = -1;  /* the smallest stamp among the unpinned (stamps are distinct; a tie: the lower key) */
        for (int64_t e = 0; e < n_keys; e++) {
            if (cached[e] && !(pinned != NULL && pinned[e]) && (v < 0 || stamp[e] < stamp[v])) {
                v = e;
            }
        }
        if (v < 0) {
            break;
        }
        cached[v] = 0;
        --*count;
        victims[n_victims++] = (int32_t) v;
    }
    return n_victims;
}
