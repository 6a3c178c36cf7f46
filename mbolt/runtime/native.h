#ifndef MBOLT_NATIVE_H
#define MBOLT_NATIVE_H
/* What mbolt's C filter (native.c) and its drop thread (drops.c) share: the filter's state and a
   decode layer's miss path, laid out as runtime.native's ctypes structures are. The expert cache
   rule both paths of the filter apply is core/lru.c's (lru.h, compiled with them). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "lru.h"

typedef bool (*eval_cb)(void * t, bool ask, void * user);

/* what the filter needs of a ggml_tensor (offsets from the binding's layout, checked there) and
   the expert cache's state, shared with Python (numpy arrays) */
struct mbolt_filter {
    eval_cb python;
    long name_offset, type_offset, ne_offset, nb_offset, data_offset;
    int32_t fast;            /* 1: a computed selection whose experts are all cached is answered here */
    int32_t n_layers, n_experts;
    const int32_t * perm;    /* [n_layers * n_experts]: position in the file -> original expert id */
    uint8_t * cached;        /* [n_layers * n_experts] by original id: in the slot cache */
    int64_t * stamp;         /* [n_layers * n_experts] by original id: last use (core.lru.ArrayLru) */
    int64_t * clock;         /* the stamps' counter */
    uint8_t * seen;          /* [n_layers]: the layers whose selection was computed this step */
    int64_t fast_layers;     /* selections answered here (cumulative) */
    int64_t fast_experts;    /* distinct experts those selections used (cumulative) */
    struct mbolt_misses * misses;  /* NULL: a selection with a miss goes to Python */
    int64_t * keys;          /* scratch [n_experts]: a selection's distinct experts, the LRU's keys */
    uint8_t * marks;         /* scratch [n_experts], all 0 between selections */
    uint8_t * waits;         /* [n_layers] or NULL: bits per layer (native.WAIT_BITS); a layer's ffn_moe_gate-N /
                                ffn_moe_up-N nodes go to Python while bit 1 is set (reads still arriving for
                                the next matmul), its attn_norm-N node while bit 2 is (its reads start there) */
};

/* a decode layer with misses, under a budget (runtime.streamer with asynchronous reads): the
   slices of every expert, the files' descriptors and llama.cpp's mapping of each, scratch space
   (Python's numpy arrays), and what was done (cumulative, taken after each step) */
struct mbolt_misses {
    int32_t slots;           /* the slot cache's size in this phase */
    int32_t n_roles;
    const int32_t * r_file;  /* [n_layers * n_experts * n_roles]: the slice's file */
    const int64_t * r_off;   /* the same: its offset in that file */
    const int64_t * r_len;   /* the same: its length (0: the layer has no such role) */
    const int32_t * fds;     /* per file */
    const int64_t * map_lo, * map_off, * map_len;  /* per file: llama.cpp's mapping */
    const int64_t * ra_step; /* per file: the most one WILLNEED reads (core.pagecache.willneed_bytes) */
    const uint8_t * visible; /* per file: the kernel shows this user its residency (else mincore says "all") */
    int64_t merge_gap;
    int64_t * count;         /* [n_layers]: cached experts (core.lru.ArrayLru's count) */
    uint8_t * read_mark;     /* [n_layers * n_experts]: read since the step's mark */
    int32_t * sel;           /* scratch [2 * n_experts]: the distinct selected experts, then the victims */
    uint8_t * in_sel;        /* scratch [n_experts] */
    int64_t * runs;          /* scratch [n_experts * n_roles * 4]: (file, start, end, role) */
    uint8_t * vec;           /* scratch: mincore's answer for the longest slice */
    int64_t vec_pages;
    int64_t layers, experts, hits, misses, reads, bytes, useful, io_ns, reclaimed, victims, errors, drop_ns;
    int32_t drop_behind;     /* 1: victims are dropped by a thread of their own while llama.cpp computes */
    int32_t use_order;       /* 1: misses read tensor by tensor in llama.cpp's use order (else in file order) */
    struct dropper * dropper;  /* that thread (created at its first drop; mbolt_drops_stop ends it) */
};

#define PAGE 4096

/* drops.c */
int mbolt_drop_range(const struct mbolt_misses * m, int64_t file, int64_t a, int64_t b);
bool mbolt_queue_drop(struct mbolt_filter * f, int layer, int64_t file, int64_t a, int64_t b);
void mbolt_wait_drops(struct mbolt_misses * m, int layer);

#endif
