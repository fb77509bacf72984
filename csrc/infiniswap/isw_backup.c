/*
 * isw_backup.c — backup file, per-slab disk ordering and the writer threads
 * (design in isw_backup.h).
 *
 * Owns: the backup file descriptor, the write queues and their writer threads, the copies
 * of queued data, and the per-slab enqueued/completed counts.
 *
 * Locks: one mutex per queue (push/pop, queued bytes) and one per slab (only to sleep
 * until that slab's completed count reaches a target).  A slab's enqueued count is bumped
 * under its queue's mutex together with the push, so "enqueued count" order is queue order
 * and, with one writer per queue, completion order.
 */
#include "isw_backup.h"
#include "isw_common.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct witem {
    struct witem *next;
    uint32_t slab;
    uint64_t off;
    size_t len;
    unsigned char data[];
};

struct wqueue {
    pthread_mutex_t mu;
    pthread_cond_t nonempty;   /* writer waits for work */
    pthread_cond_t changed;    /* producers wait for room, flushers for completions */
    struct witem *head, *tail;
    size_t bytes;              /* queued + in progress */
    size_t nitems;
    size_t cap;
    uint64_t enq, done;        /* items ever queued / completed */
    int stop;
    pthread_t th;
    int started;
    struct isw_backup *b;
};

struct bslab {
    _Alignas(64) _Atomic uint64_t enq;   /* asynchronous writes queued for this slab */
    _Atomic uint64_t done;               /* ... and completed */
    _Atomic uint64_t async_bytes;
    atomic_int err;                      /* errno of a failed asynchronous write (sticky) */
    int waiters;                         /* under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

struct isw_backup {
    int fd;
    uint64_t size;
    uint32_t nslabs;
    int nthreads;
    struct bslab *slabs;
    struct wqueue *q;
    atomic_uint delay_us;
    _Atomic uint64_t async_bytes, async_writes, errors;
    atomic_int first_err;
};

static void *writer_main(void *arg)
{
    struct wqueue *q = arg;
    struct isw_backup *b = q->b;

    for (;;) {
        pthread_mutex_lock(&q->mu);
        while (q->head == NULL && !q->stop)
            pthread_cond_wait(&q->nonempty, &q->mu);
        struct witem *it = q->head;
        if (it == NULL) {           /* stopping and drained */
            pthread_mutex_unlock(&q->mu);
            break;
        }
        q->head = it->next;
        if (q->head == NULL)
            q->tail = NULL;
        pthread_mutex_unlock(&q->mu);

        unsigned delay = atomic_load(&b->delay_us);
        if (delay)
            isw_sleep_us(delay);
        struct bslab *s = &b->slabs[it->slab];
        int rc = isw_pwrite_full(b->fd, it->data, it->len, it->off);
        if (rc < 0) {
            atomic_store(&s->err, -rc);
            atomic_fetch_add(&b->errors, 1);
            int zero = 0;
            atomic_compare_exchange_strong(&b->first_err, &zero, -rc);
        } else {
            atomic_fetch_add(&s->async_bytes, it->len);
            atomic_fetch_add(&b->async_bytes, it->len);
            atomic_fetch_add(&b->async_writes, 1);
        }
        pthread_mutex_lock(&s->mu);
        atomic_fetch_add(&s->done, 1);
        if (s->waiters)
            pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);

        pthread_mutex_lock(&q->mu);
        q->bytes -= it->len;
        q->nitems--;
        q->done++;
        pthread_cond_broadcast(&q->changed);
        pthread_mutex_unlock(&q->mu);
        free(it);
    }
    return NULL;
}

/* Wait until every asynchronous write of the slab queued before this call completed. */
static void slab_quiesce(struct bslab *s)
{
    uint64_t target = atomic_load(&s->enq);

    if (atomic_load(&s->done) >= target)
        return;
    pthread_mutex_lock(&s->mu);
    s->waiters++;
    while (atomic_load(&s->done) < target)
        pthread_cond_wait(&s->cv, &s->mu);
    s->waiters--;
    pthread_mutex_unlock(&s->mu);
}

static void stop_writers(struct isw_backup *b)
{
    for (int i = 0; i < b->nthreads; i++) {
        struct wqueue *q = &b->q[i];
        pthread_mutex_lock(&q->mu);
        q->stop = 1;
        pthread_cond_broadcast(&q->nonempty);
        pthread_cond_broadcast(&q->changed);
        pthread_mutex_unlock(&q->mu);
    }
    for (int i = 0; i < b->nthreads; i++)
        if (b->q[i].started)
            pthread_join(b->q[i].th, NULL);
}

static void free_backup(struct isw_backup *b)
{
    for (int i = 0; i < b->nthreads; i++) {
        pthread_mutex_destroy(&b->q[i].mu);
        pthread_cond_destroy(&b->q[i].nonempty);
        pthread_cond_destroy(&b->q[i].changed);
    }
    for (uint32_t i = 0; i < b->nslabs; i++) {
        pthread_mutex_destroy(&b->slabs[i].mu);
        pthread_cond_destroy(&b->slabs[i].cv);
    }
    if (b->fd >= 0)
        close(b->fd);
    free(b->q);
    free(b->slabs);
    free(b);
}

int isw_backup_open(const char *path, uint64_t size, uint32_t nslabs, int nthreads,
                    uint64_t pending_cap, struct isw_backup **out)
{
    int rc;

    if (nthreads < 1 || nthreads > 256)
        return isw_fail(EINVAL, "writer_threads must be 1..256, got %d", nthreads);
    struct isw_backup *b = calloc(1, sizeof *b);
    if (b == NULL)
        return isw_fail(ENOMEM, "out of memory");
    b->fd = -1;
    b->nthreads = nthreads;
    b->nslabs = nslabs;
    b->size = size;
    b->q = calloc((size_t)nthreads, sizeof *b->q);
    b->slabs = aligned_alloc(64, sizeof(struct bslab) * (size_t)nslabs);
    if (b->q == NULL || b->slabs == NULL) {
        free(b->q);
        free(b->slabs);
        free(b);
        return isw_fail(ENOMEM, "out of memory for %u slabs", nslabs);
    }
    memset(b->slabs, 0, sizeof(struct bslab) * (size_t)nslabs);
    for (uint32_t i = 0; i < nslabs; i++) {
        pthread_mutex_init(&b->slabs[i].mu, NULL);
        pthread_cond_init(&b->slabs[i].cv, NULL);
    }
    size_t cap = (size_t)(pending_cap / (uint64_t)nthreads);
    for (int i = 0; i < nthreads; i++) {
        pthread_mutex_init(&b->q[i].mu, NULL);
        pthread_cond_init(&b->q[i].nonempty, NULL);
        pthread_cond_init(&b->q[i].changed, NULL);
        b->q[i].cap = cap;
        b->q[i].b = b;
    }
    b->fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (b->fd < 0) {
        rc = -errno;
        free_backup(b);
        return isw_fail(-rc, "cannot create backup file '%s': %s", path, isw_strerror(rc));
    }
    if (ftruncate(b->fd, (off_t)size) < 0) {
        rc = -errno;
        free_backup(b);
        return isw_fail(-rc, "cannot size backup file '%s' to %llu bytes: %s", path,
                        (unsigned long long)size, isw_strerror(rc));
    }
    for (int i = 0; i < nthreads; i++) {
        rc = isw_thread_start(&b->q[i].th, writer_main, &b->q[i]);
        if (rc < 0) {
            stop_writers(b);
            free_backup(b);
            return isw_fail(-rc, "cannot start writer thread: %s", isw_strerror(rc));
        }
        b->q[i].started = 1;
    }
    *out = b;
    return 0;
}

int isw_backup_write_sync(struct isw_backup *b, uint32_t slab, uint64_t off, const void *buf,
                          size_t len)
{
    slab_quiesce(&b->slabs[slab]);
    int rc = isw_pwrite_full(b->fd, buf, len, off);
    if (rc < 0)
        return isw_fail(-rc, "write of %zu bytes at offset %llu to the backup file failed: %s",
                        len, (unsigned long long)off, isw_strerror(rc));
    return 0;
}

int isw_backup_write_async(struct isw_backup *b, uint32_t slab, uint64_t off, const void *buf,
                           size_t len)
{
    struct witem *it = malloc(sizeof *it + len);
    if (it == NULL)             /* no memory for the copy: write it now instead */
        return isw_backup_write_sync(b, slab, off, buf, len);
    memcpy(it->data, buf, len);
    it->next = NULL;
    it->slab = slab;
    it->off = off;
    it->len = len;

    struct wqueue *q = &b->q[slab % (uint32_t)b->nthreads];
    pthread_mutex_lock(&q->mu);
    while (q->bytes > 0 && q->bytes + len > q->cap && !q->stop)
        pthread_cond_wait(&q->changed, &q->mu);
    if (q->stop) {
        pthread_mutex_unlock(&q->mu);
        free(it);
        return isw_fail(EBADF, "backup file is closed");
    }
    if (q->tail)
        q->tail->next = it;
    else
        q->head = it;
    q->tail = it;
    q->bytes += len;
    q->nitems++;
    q->enq++;
    atomic_fetch_add(&b->slabs[slab].enq, 1);
    pthread_cond_signal(&q->nonempty);
    pthread_mutex_unlock(&q->mu);
    return 0;
}

int isw_backup_read(struct isw_backup *b, uint32_t slab, uint64_t off, void *buf, size_t len)
{
    struct bslab *s = &b->slabs[slab];

    slab_quiesce(s);
    int err = atomic_load(&s->err);
    if (err)
        return isw_fail(EIO, "slab %u: an earlier background write to the backup file failed "
                        "(%s); its data on disk may be stale", slab, isw_strerror(err));
    int rc = isw_pread_full(b->fd, buf, len, off);
    if (rc < 0)
        return isw_fail(-rc, "read of %zu bytes at offset %llu from the backup file failed: %s",
                        len, (unsigned long long)off, isw_strerror(rc));
    return 0;
}

int isw_backup_flush(struct isw_backup *b)
{
    for (int i = 0; i < b->nthreads; i++) {
        struct wqueue *q = &b->q[i];
        pthread_mutex_lock(&q->mu);
        uint64_t target = q->enq;
        while (q->done < target)
            pthread_cond_wait(&q->changed, &q->mu);
        pthread_mutex_unlock(&q->mu);
    }
    int err = atomic_load(&b->first_err);
    if (err)
        return isw_fail(err, "a background write to the backup file failed: %s",
                        isw_strerror(err));
    if (fdatasync(b->fd) < 0) {
        int rc = -errno;
        return isw_fail(-rc, "fdatasync of the backup file failed: %s", isw_strerror(rc));
    }
    return 0;
}

int isw_backup_close(struct isw_backup *b)
{
    int rc = isw_backup_flush(b);
    stop_writers(b);
    free_backup(b);
    return rc;
}

void isw_backup_set_delay_us(struct isw_backup *b, uint32_t us)
{
    atomic_store(&b->delay_us, us);
}

void isw_backup_get_stats(struct isw_backup *b, struct isw_backup_stats *out)
{
    memset(out, 0, sizeof *out);
    for (int i = 0; i < b->nthreads; i++) {
        struct wqueue *q = &b->q[i];
        pthread_mutex_lock(&q->mu);
        out->pending_bytes += q->bytes;
        out->pending_writes += q->nitems;
        pthread_mutex_unlock(&q->mu);
    }
    out->async_bytes = atomic_load(&b->async_bytes);
    out->async_writes = atomic_load(&b->async_writes);
    out->errors = atomic_load(&b->errors);
}

uint64_t isw_backup_slab_pending(struct isw_backup *b, uint32_t slab)
{
    struct bslab *s = &b->slabs[slab];
    uint64_t done = atomic_load(&s->done);
    uint64_t enq = atomic_load(&s->enq);
    return enq > done ? enq - done : 0;
}

uint64_t isw_backup_slab_async_bytes(struct isw_backup *b, uint32_t slab)
{
    return atomic_load(&b->slabs[slab].async_bytes);
}
