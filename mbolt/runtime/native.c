/* mbolt's eval-callback filter and decode-layer reads in C (runtime.native builds and loads it
   with drops.c and core/lru.c, the expert cache rule both of its paths call). PREFIX and
   PREFIX_LEN are replaced with the selection nodes' name prefix before compiling. */
#include "native.h"

/* a computed ffn_moe_topk-N node: n rows of k int32 positions, rows strided by `stride` bytes (a
   view of an argsort over every expert) */
struct selection {
    int64_t k, n;
    size_t stride;
    const char * data;
};

static bool read_selection(const struct mbolt_filter * f, const char * t, int layer, struct selection * s) {
    if (!f->fast || layer < 0 || layer >= f->n_layers || *(const int *) (t + f->type_offset) != 26 /* I32 */) {
        return false;
    }
    const int64_t * ne = (const int64_t *) (t + f->ne_offset);
    s->k = ne[0];
    s->n = ne[1];
    s->stride = ((const size_t *) (t + f->nb_offset))[1];
    s->data = *(char * const *) (t + f->data_offset);
    return true;
}

static const int32_t * row_of(const struct selection * s, int64_t j) {
    return (const int32_t *) (s->data + j * s->stride);
}

/* the selection's distinct experts (original ids, through the perm) into f->keys, by last use, the
   last used last: the keys of the cache rule's admit (core/lru.c), as Python admits a step
   (runtime.streamer: the perm of core.lru.by_last_use). Every use stamped in row order, then rank
   order, leaves the cache in this order. -1: an id out of range (the selection is Python's). */
static int64_t selection_keys(struct mbolt_filter * f, int layer, const struct selection * s) {
    const int32_t * perm = f->perm + (int64_t) layer * f->n_experts;
    int64_t n = 0;
    bool bad = false;
    for (int64_t j = s->n - 1; j >= 0 && !bad; j--) {
        const int32_t * row = row_of(s, j);
        for (int64_t i = s->k - 1; i >= 0; i--) {
            if (row[i] < 0 || row[i] >= f->n_experts) {
                bad = true;
                break;
            }
            const int32_t e = perm[row[i]];
            if (!f->marks[e]) {
                f->marks[e] = 1;
                f->keys[n++] = e;
            }
        }
    }
    for (int64_t i = 0; i < n; i++) {
        f->marks[f->keys[i]] = 0;
    }
    for (int64_t a = 0, b = n - 1; a < b; a++, b--) {  /* first seen from the end -> last used last */
        const int64_t e = f->keys[a];
        f->keys[a] = f->keys[b];
        f->keys[b] = e;
    }
    return bad ? -1 : n;
}

/* every id of the computed selection is a cached expert: the cache rule's admit, without Python.
   Nothing enters, so nothing has to leave (the cache holds at most its slots, which Python keeps
   without a budget): its first half alone, the stamps (core/lru.c's mbolt_lru_use). */
static bool all_cached(struct mbolt_filter * f, const char * t, int layer) {
    struct selection s;
    if (!read_selection(f, t, layer, &s)) {
        return false;
    }
    const int32_t * perm = f->perm + (int64_t) layer * f->n_experts;
    uint8_t * cached = f->cached + (int64_t) layer * f->n_experts;
    for (int64_t j = 0; j < s.n; j++) {
        const int32_t * row = row_of(&s, j);
        for (int64_t i = 0; i < s.k; i++) {
            if (row[i] < 0 || row[i] >= f->n_experts || !cached[perm[row[i]]]) {
                return false;
            }
        }
    }
    const int64_t n = selection_keys(f, layer, &s);
    mbolt_lru_use(cached, f->stamp + (int64_t) layer * f->n_experts, f->clock, f->keys, n);
    f->fast_layers += 1;
    f->fast_experts += n;  /* a batched step's rows share experts: the union is what the store counts */
    return true;
}

static int cmp_run(const void * a, const void * b) {
    const int64_t * x = a, * y = b;
    for (int i = 0; i < 2; i++) {
        if (x[i] != y[i]) {
            return x[i] < y[i] ? -1 : 1;
        }
    }
    return 0;
}

/* by role (the roles come in llama.cpp's use order: gate, up, down), then file and start */
static int cmp_use(const void * a, const void * b) {
    const int64_t * x = a, * y = b;
    return x[3] != y[3] ? (x[3] < y[3] ? -1 : 1) : cmp_run(a, b);
}

/* the slices of these experts as runs (file, start, end, role), sorted by file and start, or
   (by_use) in the order llama.cpp's matmuls use them */
static int64_t slices(struct mbolt_filter * f, int layer, const int32_t * es, int64_t n, bool by_use) {
    struct mbolt_misses * m = f->misses;
    int64_t nr = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t base = ((int64_t) layer * f->n_experts + es[i]) * m->n_roles;
        for (int r = 0; r < m->n_roles; r++) {
            if (m->r_len[base + r] > 0) {
                int64_t * run = m->runs + 4 * nr++;
                run[0] = m->r_file[base + r];
                run[1] = m->r_off[base + r];
                run[2] = run[1] + m->r_len[base + r];
                run[3] = r;
            }
        }
    }
    qsort(m->runs, nr, 4 * sizeof(int64_t), by_use ? cmp_use : cmp_run);
    return nr;
}

/* submit a range's read (WILLNEED, at most ra_step per call); returns the failed calls */
static int read_range(const struct mbolt_misses * m, int64_t file, int64_t a, int64_t b) {
    int failed = 0;
    for (int64_t x = a; x < b; x += m->ra_step[file]) {
        const int64_t len = b - x < m->ra_step[file] ? b - x : m->ra_step[file];
        failed += posix_fadvise(m->fds[file], x, len, POSIX_FADV_WILLNEED) != 0;
    }
    return failed;
}

/* unmap these experts' whole pages from llama.cpp's mapping and drop them from the page cache:
   slices that touch are joined first, then shrunk to the pages inside (runtime.pages.expert_spans_of) */
static void drop(struct mbolt_filter * f, int layer, const int32_t * es, int64_t n, bool behind) {
    struct mbolt_misses * m = f->misses;
    const int64_t nr = slices(f, layer, es, n, false);
    for (int64_t i = 0; i < nr;) {
        const int64_t file = m->runs[4 * i];
        int64_t a = m->runs[4 * i + 1], b = m->runs[4 * i + 2];
        for (i++; i < nr && m->runs[4 * i] == file && m->runs[4 * i + 1] <= b; i++) {
            if (m->runs[4 * i + 2] > b) {
                b = m->runs[4 * i + 2];
            }
        }
        a = (a + PAGE - 1) / PAGE * PAGE;
        b = b / PAGE * PAGE;
        if (b <= a) {
            continue;
        }
        if (!(behind && mbolt_queue_drop(f, layer, file, a, b))) {
            m->errors += mbolt_drop_range(m, file, a, b);
        }
    }
}

/* every whole page inside the expert's slices is in the page cache (mincore through the mapping) */
static bool resident(struct mbolt_filter * f, int layer, int32_t e) {
    struct mbolt_misses * m = f->misses;
    const int64_t base = ((int64_t) layer * f->n_experts + e) * m->n_roles;
    for (int r = 0; r < m->n_roles; r++) {
        const int64_t file = m->r_file[base + r];
        int64_t a = m->r_off[base + r], b = a + m->r_len[base + r];
        a = (a + PAGE - 1) / PAGE * PAGE;
        b = b / PAGE * PAGE;
        if (!m->visible[file] || b <= a || a < m->map_off[file] || b > m->map_off[file] + m->map_len[file]
            || (b - a) / PAGE > m->vec_pages) {
            continue;
        }
        if (mincore((void *) (m->map_lo[file] + a - m->map_off[file]), b - a, m->vec) != 0) {
            m->errors++;
            return false;
        }
        for (int64_t p = 0; p < (b - a) / PAGE; p++) {
            if (!(m->vec[p] & 1)) {
                return false;
            }
        }
    }
    return true;
}

/* a decode step's layer with a miss, under the slot cache's rule (core.lru.ArrayLru, the same
   arrays): cached experts the kernel reclaimed in part are read again (what is left of them
   dropped); the misses' slices merged per tensor (core.ranges.merge_ranges: a hole of at most
   merge_gap joins) and submitted with WILLNEED tensor by tensor in llama.cpp's use order (use_order;
   else in file order), each in file order (llama.cpp's faults wait for pages in flight); then the
   cache rule's admit (core/lru.c, the one Python's store calls too): the misses in, the least
   recently used beyond the slots out of the cache, and out of the mapping and page cache at once.
   Python (runtime.streamer) does the same when this is off, and whenever a step selects more
   experts than the cache holds. */
static bool with_misses(struct mbolt_filter * f, const char * t, int layer) {
    struct mbolt_misses * m = f->misses;
    struct selection s;
    if (m == NULL || !read_selection(f, t, layer, &s)) {
        return false;
    }
    const int64_t E = f->n_experts;
    const int32_t * perm = f->perm + (int64_t) layer * E;
    uint8_t * cached = f->cached + (int64_t) layer * E;
    int64_t nsel = 0;
    for (int64_t j = 0; j < s.n; j++) {
        const int32_t * row = row_of(&s, j);
        for (int64_t i = 0; i < s.k; i++) {
            if (row[i] < 0 || row[i] >= E) {
                goto python;
            }
            const int32_t e = perm[row[i]];
            if (!m->in_sel[e]) {
                m->in_sel[e] = 1;
                m->sel[nsel++] = e;
            }
        }
    }
    if (nsel > m->slots) {
        goto python;  /* the union outgrows the cache: Python keeps what the read still needs */
    }
    /* reclaimed in part: out of the cache, what is left dropped, read again below */
    for (int64_t i = 0; i < nsel; i++) {
        const int32_t e = m->sel[i];
        if (cached[e] && !resident(f, layer, e)) {
            drop(f, layer, &e, 1, false);  /* now: it is read again below */
            cached[e] = 0;
            m->count[layer]--;
            m->reclaimed++;
        }
    }
    /* the misses, moved to the front of sel (in first-seen order) */
    int64_t nmiss = 0;
    for (int64_t i = 0; i < nsel; i++) {
        const int32_t e = m->sel[i];
        if (!cached[e]) {
            m->sel[i] = m->sel[nmiss];
            m->sel[nmiss++] = e;
            m->read_mark[(int64_t) layer * E + e] = 1;
        }
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    const int64_t nr = slices(f, layer, m->sel, nmiss, m->use_order != 0);  /* the gate's pages first */
    for (int64_t i = 0; i < nr;) {
        const int64_t file = m->runs[4 * i], role = m->runs[4 * i + 3];
        const int64_t a = m->runs[4 * i + 1];
        int64_t b = m->runs[4 * i + 2];
        m->useful += b - a;
        for (i++; i < nr && m->runs[4 * i] == file && m->runs[4 * i + 3] == role
                  && m->runs[4 * i + 1] <= b + m->merge_gap; i++) {
            m->useful += m->runs[4 * i + 2] - m->runs[4 * i + 1];
            if (m->runs[4 * i + 2] > b) {
                b = m->runs[4 * i + 2];
            }
        }
        m->errors += read_range(m, file, a, b);
        m->reads++;
        m->bytes += b - a;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    m->io_ns += (t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec);
    /* the LRU's admit, no pins (the streamer keeps this path off with pins). Only entries older
       than this step leave: its keys are stamped after all others and fit in the slots (nsel <=
       slots above), so the count - slots least recently used are all from before it. */
    const int64_t nkeys = selection_keys(f, layer, &s);
    int32_t * victims = m->sel + nsel;  /* sel has room for every expert after the selected ones */
    const int64_t nvict = mbolt_lru_admit(cached, f->stamp + (int64_t) layer * E, E, f->clock, m->count + layer,
                                          m->slots, NULL, f->keys, nkeys, victims);
    if (nvict > 0) {
        drop(f, layer, victims, nvict, true);
    }
    for (int64_t i = 0; i < nsel; i++) {
        m->in_sel[m->sel[i]] = 0;
    }
    m->layers += 1;
    m->experts += nsel;
    m->hits += nsel - nmiss;
    m->misses += nmiss;
    m->victims += nvict;
    return true;
python:
    for (int64_t i = 0; i < nsel; i++) {
        m->in_sel[m->sel[i]] = 0;
    }
    return false;
}

/* ggml_backend_sched_eval_callback: the scheduler asks about every node (ask), then hands over
   the ones we asked for once computed; only computed ffn_moe_topk-N nodes with an uncached expert
   reach Python */
static int wait_node(const char * name, uint8_t * bit) {
    if (strncmp(name, "ffn_moe_gate-", 13) == 0) {
        *bit = 1;
        return 13;
    }
    if (strncmp(name, "ffn_moe_up-", 11) == 0) {
        *bit = 1;
        return 11;
    }
    if (strncmp(name, "attn_norm-", 10) == 0) {
        *bit = 2;
        return 10;
    }
    return 0;
}

bool mbolt_topk_filter(void * t, bool ask, void * user) {
    struct mbolt_filter * f = (struct mbolt_filter *) user;
    const char * name = (const char *) t + f->name_offset;
    if (strncmp(name, "PREFIX", PREFIX_LEN) != 0) {
        uint8_t bit = 0;
        const int len = f->waits != NULL ? wait_node(name, &bit) : 0;
        if (len == 0) {
            return !ask;
        }
        /* a node another read waits at (native.WAIT_NODES): the graph is split there only while
           its layer's bit is set (asked as the scheduler reaches it, after the selection before it) */
        const int layer = atoi(name + len);
        const bool on = layer >= 0 && layer < f->n_layers && (f->waits[layer] & bit);
        if (ask) {
            return on;
        }
        return on ? f->python(t, ask, NULL) : true;
    }
    if (ask) {
        return true;
    }
    const int layer = atoi(name + PREFIX_LEN);
    if (f->seen != NULL && layer >= 0 && layer < f->n_layers) {
        f->seen[layer] = 1;
    }
    if (all_cached(f, (const char *) t, layer)) {
        return true;
    }
    if (layer >= 0 && layer < f->n_layers) {
        mbolt_wait_drops(f->misses, layer);  /* this layer's victims gone before it reads (one may be read again) */
    }
    if (with_misses(f, (const char *) t, layer)) {
        return true;
    }
    return f->python(t, ask, NULL);
}

/* ggml_abort_callback: llama.cpp's CPU backend asks it between graph nodes; a set flag stops the
   graph (a server's client went away in the middle of a prompt) */
bool mbolt_abort_flag(void * data) {
    return *(volatile int *) data != 0;
}
