#ifndef MBOLT_LRU_H
#define MBOLT_LRU_H
/* The one expert cache rule (lru.c): what core.lru.ArrayLru binds through ctypes and the runtime's
   C filter (runtime/native.c) calls. */
#include <stddef.h>
#include <stdint.h>

int64_t mbolt_lru_use(uint8_t * cached, int64_t * stamp, int64_t * clock, const int64_t * keys, int64_t n);
int64_t mbolt_lru_admit(uint8_t * cached, int64_t * stamp, int64_t n_keys, int64_t * clock, int64_t * count,
                        int64_t slots, const uint8_t * pinned, const int64_t * keys, int64_t n, int32_t * victims);

#endif
