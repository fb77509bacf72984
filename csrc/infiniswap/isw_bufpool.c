/*
 * isw_bufpool.c — per-thread I/O buffers from a preallocated pool (see isw_bufpool.h).
 *
 * Owns: the buffer mappings, the free list (under mu) and the thread-specific key whose
 * destructor returns a thread's buffer.  Preallocated buffers live in one array (`all`)
 * and are unmapped together by isw_bufpool_destroy(); a buffer mapped on demand (pool
 * empty) is unmapped by the destructor of the thread that used it.
 */
#include "isw_bufpool.h"
#include "isw_common.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

struct pooled_buf {
    struct pooled_buf *next;
    struct isw_bufpool *owner;
    int pooled;                 /* from the preallocated array (else mapped on demand) */
    unsigned char *data;        /* owner->size bytes */
};

struct isw_bufpool {
    size_t size;
    pthread_key_t key;
    int key_ok;
    pthread_mutex_t mu;
    struct pooled_buf *free;    /* free preallocated buffers; under mu */
    struct pooled_buf *all;     /* every preallocated buffer (array) */
    int nbufs;                  /* mapped entries of `all` */
};

static unsigned char *map_buffer(size_t size)
{
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
    (void)mlock(p, size);       /* best effort: without CAP_IPC_LOCK it may fail */
    return p;
}

/* The key's destructor: a thread that took buffer b exits. */
static void buffer_release(void *arg)
{
    struct pooled_buf *b = arg;
    struct isw_bufpool *p = b->owner;

    if (b->pooled) {
        pthread_mutex_lock(&p->mu);
        b->next = p->free;
        p->free = b;
        pthread_mutex_unlock(&p->mu);
    } else {
        munmap(b->data, p->size);
        free(b);
    }
}

unsigned char *isw_bufpool_thread_buffer(struct isw_bufpool *p)
{
    struct pooled_buf *b = pthread_getspecific(p->key);

    if (b != NULL)
        return b->data;
    pthread_mutex_lock(&p->mu);
    b = p->free;
    if (b != NULL)
        p->free = b->next;
    pthread_mutex_unlock(&p->mu);
    if (b == NULL) {
        b = calloc(1, sizeof *b);
        if (b == NULL)
            return NULL;
        b->owner = p;
        b->data = map_buffer(p->size);
        if (b->data == NULL) {
            free(b);
            return NULL;
        }
    }
    if (pthread_setspecific(p->key, b) != 0) {
        buffer_release(b);
        return NULL;
    }
    return b->data;
}

void isw_bufpool_destroy(struct isw_bufpool *p)
{
    if (p == NULL)
        return;
    if (p->key_ok)
        pthread_key_delete(p->key);
    for (int i = 0; i < p->nbufs; i++)
        munmap(p->all[i].data, p->size);
    free(p->all);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

int isw_bufpool_create(int nbufs, size_t size, struct isw_bufpool **out)
{
    int rc;

    if (nbufs < 0 || size == 0)
        return isw_fail(EINVAL, "a buffer pool needs nbufs >= 0 and size > 0");
    struct isw_bufpool *p = calloc(1, sizeof *p);
    if (p == NULL)
        return isw_fail(ENOMEM, "out of memory");
    p->size = size;
    pthread_mutex_init(&p->mu, NULL);
    if ((rc = pthread_key_create(&p->key, buffer_release)) != 0) {
        rc = isw_fail(rc, "pthread_key_create: %s", strerror(rc));
        isw_bufpool_destroy(p);
        return rc;
    }
    p->key_ok = 1;
    p->all = calloc(nbufs > 0 ? (size_t)nbufs : 1, sizeof *p->all);
    if (p->all == NULL) {
        isw_bufpool_destroy(p);
        return isw_fail(ENOMEM, "out of memory");
    }
    for (int i = 0; i < nbufs; i++) {
        struct pooled_buf *b = &p->all[i];
        b->data = map_buffer(size);
        if (b->data == NULL) {
            rc = isw_fail(ENOMEM, "cannot map a %zu-byte I/O buffer: %s", size, strerror(errno));
            isw_bufpool_destroy(p);
            return rc;
        }
        b->owner = p;
        b->pooled = 1;
        b->next = p->free;
        p->free = b;
        p->nbufs++;
    }
    *out = p;
    return 0;
}
