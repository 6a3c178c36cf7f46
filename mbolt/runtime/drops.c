/* The drop thread of the C filter (native.c): a decode layer's victims dropped behind the layer. */
#include "native.h"

/* Dropping a victim (unmap its pages from llama.cpp's mapping, then drop them from the page cache)
   costs the kernel about 0.2 ms per 864 KiB slice: on q864 about 7 ms of each token, spent on the
   path between a layer's selection and its matmuls. The victims are not used by the step that
   evicts them, so a thread drops them behind the step instead: the callback queues their page
   ranges and returns. A layer's queued drops are done before that layer is answered again
   (mbolt_topk_filter waits for them), and every drop is done before a llama_decode returns to
   the driver (mbolt_drops_flush), so Python never sees a drop in flight. */
struct drop_job {
    int64_t file, a, b, layer;
};

struct dropper {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work, idle;
    struct drop_job * q;
    int64_t cap, head, n;    /* a ring of queued ranges */
    int64_t * pending;       /* [n_layers]: queued or running ranges of each layer */
    int64_t busy;            /* ranges taken by the thread and not done yet */
    int64_t errors, ns;
    int stop;
    struct mbolt_misses * m;
};

/* one page range of a file out of llama.cpp's mapping and the page cache; returns the failed calls */
int mbolt_drop_range(const struct mbolt_misses * m, int64_t file, int64_t a, int64_t b) {
    int failed = 0;
    const int64_t lo = a > m->map_off[file] ? a : m->map_off[file];
    const int64_t hi = b < m->map_off[file] + m->map_len[file] ? b : m->map_off[file] + m->map_len[file];
    if (hi > lo && madvise((void *) (m->map_lo[file] + lo - m->map_off[file]), hi - lo, MADV_DONTNEED) != 0) {
        failed++;
    }
    if (posix_fadvise(m->fds[file], a, b - a, POSIX_FADV_DONTNEED) != 0) {
        failed++;
    }
    return failed;
}

static void * drop_loop(void * arg) {
    struct dropper * d = arg;
    pthread_mutex_lock(&d->mu);
    for (;;) {
        while (d->n == 0 && !d->stop) {
            pthread_cond_wait(&d->work, &d->mu);
        }
        if (d->n == 0) {
            break;
        }
        const struct drop_job job = d->q[d->head];
        d->head = (d->head + 1) % d->cap;
        d->n--;
        d->busy++;
        pthread_mutex_unlock(&d->mu);
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        const int failed = mbolt_drop_range(d->m, job.file, job.a, job.b);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        pthread_mutex_lock(&d->mu);
        d->errors += failed;
        d->ns += (t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec);
        d->busy--;
        d->pending[job.layer]--;
        pthread_cond_broadcast(&d->idle);
    }
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

/* queue a range for the drop thread (started here the first time); false: drop it now (drops
   behind are off, or the thread or its queue could not be had) */
bool mbolt_queue_drop(struct mbolt_filter * f, int layer, int64_t file, int64_t a, int64_t b) {
    struct mbolt_misses * m = f->misses;
    if (!m->drop_behind) {
        return false;
    }
    struct dropper * d = m->dropper;
    if (d == NULL) {
        d = calloc(1, sizeof(*d));
        if (d == NULL) {
            m->drop_behind = 0;
            return false;
        }
        d->cap = 4096;
        d->q = calloc(d->cap, sizeof(*d->q));
        d->pending = calloc(f->n_layers, sizeof(*d->pending));
        d->m = m;
        pthread_mutex_init(&d->mu, NULL);
        pthread_cond_init(&d->work, NULL);
        pthread_cond_init(&d->idle, NULL);
        if (d->q == NULL || d->pending == NULL || pthread_create(&d->thread, NULL, drop_loop, d) != 0) {
            free(d->q);
            free(d->pending);
            free(d);
            m->drop_behind = 0;
            return false;
        }
        pthread_setname_np(d->thread, "mbolt-drops");
        m->dropper = d;
    }
    pthread_mutex_lock(&d->mu);
    const bool room = d->n < d->cap;
    if (room) {
        d->q[(d->head + d->n) % d->cap] = (struct drop_job) {file, a, b, layer};
        d->n++;
        d->pending[layer]++;
        pthread_cond_signal(&d->work);
    }
    pthread_mutex_unlock(&d->mu);
    return room;
}

/* wait until the layer's queued drops (every layer's: layer < 0) are done */
void mbolt_wait_drops(struct mbolt_misses * m, int layer) {
    struct dropper * d = m == NULL ? NULL : m->dropper;
    if (d == NULL) {
        return;
    }
    pthread_mutex_lock(&d->mu);
    while (layer >= 0 ? d->pending[layer] > 0 : (d->n > 0 || d->busy > 0)) {
        pthread_cond_wait(&d->idle, &d->mu);
    }
    if (layer < 0) {
        m->errors += d->errors;
        m->drop_ns += d->ns;
        d->errors = d->ns = 0;
    }
    pthread_mutex_unlock(&d->mu);
}

/* every queued drop done, its counts added to the misses' (the driver calls it after each llama_decode) */
void mbolt_drops_flush(struct mbolt_misses * m) {
    mbolt_wait_drops(m, -1);
}

/* the drop thread's queue emptied and the thread ended (before the mapping or the descriptors go) */
void mbolt_drops_stop(struct mbolt_misses * m) {
    struct dropper * d = m->dropper;
    if (d == NULL) {
        return;
    }
    mbolt_wait_drops(m, -1);
    pthread_mutex_lock(&d->mu);
    d->stop = 1;
    pthread_cond_signal(&d->work);
    pthread_mutex_unlock(&d->mu);
    pthread_join(d->thread, NULL);
    pthread_mutex_destroy(&d->mu);
    pthread_cond_destroy(&d->work);
    pthread_cond_destroy(&d->idle);
    free(d->q);
    free(d->pending);
    free(d);
    m->dropper = NULL;
}
