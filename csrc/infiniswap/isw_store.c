/*
 * isw_store.c — the daemon's slab store (see isw_store.h).
 *
 * Owns: the memfd and its mapping, the slot states, the allocated/locked counts and the
 * store's lifetime (closed and freed only once no data server uses it).
 *
 * The memfd is sized to the full capacity up front (sparse: tmpfs allocates nothing until
 * a slab is fallocated) and never shrinks, so a device's MAP_SHARED mapping of it never
 * faults.  Slot states are atomics so the data server can validate regions without a lock;
 * allocation and freeing serialize on the store mutex.
 */
#include "isw_store.h"
#include "isw_common.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#define SLOT_FREE 0
#define SLOT_ALLOC 1
#define SLOT_LOCKED 2

struct isw_store {
    int fd;
    unsigned char *base;
    uint64_t capacity, slab_size;
    uint32_t nslots;
    _Atomic unsigned char *slot;
    uint32_t nalloc, nlocked;       /* under mu */
    pthread_mutex_t mu;
    _Atomic int64_t ops;
    atomic_int closed;
    int users;                      /* data servers; under mu */
    int free_requested;             /* under mu */
};

static int st_enter(struct isw_store *s)
{
    atomic_fetch_add(&s->ops, 1);
    if (atomic_load(&s->closed)) {
        atomic_fetch_sub(&s->ops, 1);
        return isw_fail(EBADF, "slab store is closed");
    }
    return 0;
}

static void st_leave(struct isw_store *s)
{
    atomic_fetch_sub(&s->ops, 1);
}

int isw_store_open(uint64_t capacity, uint64_t slab_size, struct isw_store **out)
{
    int rc;

    if (!isw_is_pow2(slab_size) || slab_size < ISW_MIN_SLAB_SIZE)
        return isw_fail(EINVAL, "slab_size %" PRIu64 " must be a power of two >= %" PRIu64,
                        slab_size, ISW_MIN_SLAB_SIZE);
    if (capacity == 0 || capacity % slab_size != 0)
        return isw_fail(EINVAL, "capacity %" PRIu64 " must be a positive multiple of "
                        "slab_size %" PRIu64, capacity, slab_size);
    if (capacity / slab_size > UINT32_MAX)
        return isw_fail(EINVAL, "capacity %" PRIu64 " has too many slabs", capacity);
    struct isw_store *s = calloc(1, sizeof *s);
    if (s == NULL)
        return isw_fail(ENOMEM, "out of memory");
    s->capacity = capacity;
    s->slab_size = slab_size;
    s->nslots = (uint32_t)(capacity / slab_size);
    s->slot = calloc(s->nslots, 1);
    if (s->slot == NULL) {
        free(s);
        return isw_fail(ENOMEM, "out of memory");
    }
    s->fd = memfd_create("infiniswap-slabs", MFD_CLOEXEC);
    if (s->fd < 0) {
        rc = -errno;
        goto fail;
    }
    if (ftruncate(s->fd, (off_t)capacity) < 0) {
        rc = -errno;
        goto fail;
    }
    s->base = mmap(NULL, capacity, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
    if (s->base == MAP_FAILED) {
        rc = -errno;
        goto fail;
    }
    pthread_mutex_init(&s->mu, NULL);
    *out = s;
    return 0;
fail:
    if (s->fd >= 0)
        close(s->fd);
    free((void *)s->slot);
    free(s);
    return isw_fail(-rc, "cannot create the %" PRIu64 "-byte slab memfd: %s", capacity,
                    isw_strerror(rc));
}

static void really_close(struct isw_store *s)
{
    munmap(s->base, s->capacity);
    close(s->fd);
    s->fd = -1;
}

int isw_store_close(struct isw_store *s)
{
    pthread_mutex_lock(&s->mu);
    if (s->users > 0) {
        pthread_mutex_unlock(&s->mu);
        return isw_fail(EBUSY, "the slab store is used by a running data server; stop it first");
    }
    if (atomic_exchange(&s->closed, 1)) {
        pthread_mutex_unlock(&s->mu);
        return 0;
    }
    pthread_mutex_unlock(&s->mu);
    while (atomic_load(&s->ops) != 0)
        isw_sleep_us(50);
    really_close(s);
    return 0;
}

static void destroy(struct isw_store *s)
{
    pthread_mutex_destroy(&s->mu);
    free((void *)s->slot);
    free(s);
}

void isw_store_free(struct isw_store *s)
{
    if (s == NULL)
        return;
    pthread_mutex_lock(&s->mu);
    if (s->users > 0) {         /* the last data server frees it */
        s->free_requested = 1;
        pthread_mutex_unlock(&s->mu);
        return;
    }
    pthread_mutex_unlock(&s->mu);
    isw_store_close(s);
    destroy(s);
}

void isw_store_acquire(struct isw_store *s)
{
    pthread_mutex_lock(&s->mu);
    s->users++;
    pthread_mutex_unlock(&s->mu);
}

void isw_store_release(struct isw_store *s)
{
    pthread_mutex_lock(&s->mu);
    int last = --s->users == 0 && s->free_requested;
    pthread_mutex_unlock(&s->mu);
    if (last) {
        isw_store_close(s);
        destroy(s);
    }
}

int isw_store_fd(struct isw_store *s)
{
    return atomic_load(&s->closed) ? isw_fail(EBADF, "slab store is closed") : s->fd;
}

uint64_t isw_store_capacity(struct isw_store *s) { return s->capacity; }
uint64_t isw_store_slab_size(struct isw_store *s) { return s->slab_size; }
unsigned char *isw_store_base(struct isw_store *s) { return s->base; }

static void format_memlock(char *out, size_t n)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_MEMLOCK, &rl) < 0)
        snprintf(out, n, "unknown");
    else if (rl.rlim_cur == RLIM_INFINITY)
        snprintf(out, n, "unlimited");
    else
        snprintf(out, n, "%llu KiB", (unsigned long long)rl.rlim_cur / 1024);
}

int isw_store_alloc_slab(struct isw_store *s, int lock, uint64_t *region_offset)
{
    int rc = st_enter(s);
    if (rc < 0)
        return rc;
    pthread_mutex_lock(&s->mu);
    uint32_t i;
    for (i = 0; i < s->nslots; i++)
        if (atomic_load(&s->slot[i]) == SLOT_FREE)
            break;
    if (i == s->nslots) {
        rc = isw_fail(ENOSPC, "all %u slabs of the store are allocated", s->nslots);
        goto out;
    }
    uint64_t off = (uint64_t)i * s->slab_size;
    if (fallocate(s->fd, 0, (off_t)off, (off_t)s->slab_size) < 0) {
        rc = -errno;
        rc = isw_fail(-rc, "cannot allocate %" PRIu64 " bytes of slab memory: %s",
                      s->slab_size, isw_strerror(rc));
        goto out;
    }
    if (lock && mlock(s->base + off, s->slab_size) < 0) {
        char lim[64];
        rc = -errno;
        format_memlock(lim, sizeof lim);
        fallocate(s->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)off,
                  (off_t)s->slab_size);
        rc = isw_fail(-rc, "mlock of a %" PRIu64 "-byte slab failed: %s (RLIMIT_MEMLOCK is "
                      "%s, %u slabs already locked); raise the limit (ulimit -l, "
                      "LimitMEMLOCK=) or allocate with lock=False", s->slab_size,
                      isw_strerror(rc), lim, s->nlocked);
        goto out;
    }
    atomic_store(&s->slot[i], lock ? SLOT_LOCKED : SLOT_ALLOC);
    s->nalloc++;
    if (lock)
        s->nlocked++;
    *region_offset = off;
    rc = 0;
out:
    pthread_mutex_unlock(&s->mu);
    st_leave(s);
    return rc;
}

int isw_store_free_slab(struct isw_store *s, uint64_t region_offset)
{
    int rc = st_enter(s);
    if (rc < 0)
        return rc;
    pthread_mutex_lock(&s->mu);
    uint64_t i = region_offset / s->slab_size;
    if (region_offset % s->slab_size != 0 || i >= s->nslots ||
        atomic_load(&s->slot[i]) == SLOT_FREE) {
        rc = isw_fail(EINVAL, "region offset %" PRIu64 " is not an allocated slab",
                      region_offset);
        goto out;
    }
    int st = atomic_exchange(&s->slot[i], SLOT_FREE);
    if (st == SLOT_LOCKED) {
        munlock(s->base + region_offset, s->slab_size);
        s->nlocked--;
    }
    s->nalloc--;
    if (fallocate(s->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)region_offset,
                  (off_t)s->slab_size) < 0) {
        rc = -errno;
        rc = isw_fail(-rc, "cannot release slab memory at %" PRIu64 ": %s", region_offset,
                      isw_strerror(rc));
    }
out:
    pthread_mutex_unlock(&s->mu);
    st_leave(s);
    return rc;
}

uint64_t isw_store_allocated_bytes(struct isw_store *s)
{
    pthread_mutex_lock(&s->mu);
    uint64_t n = (uint64_t)s->nalloc * s->slab_size;
    pthread_mutex_unlock(&s->mu);
    return n;
}

uint64_t isw_store_locked_bytes(struct isw_store *s)
{
    pthread_mutex_lock(&s->mu);
    uint64_t n = (uint64_t)s->nlocked * s->slab_size;
    pthread_mutex_unlock(&s->mu);
    return n;
}

int isw_store_resident_bytes(struct isw_store *s, uint64_t *out)
{
    struct stat st;
    int rc = st_enter(s);

    if (rc < 0)
        return rc;
    if (fstat(s->fd, &st) < 0) {
        rc = -errno;
        rc = isw_fail(-rc, "fstat of the slab memfd failed: %s", isw_strerror(rc));
    } else {
        *out = (uint64_t)st.st_blocks * 512u;
    }
    st_leave(s);
    return rc;
}

int isw_store_check_region(struct isw_store *s, uint64_t off, uint64_t len)
{
    if (len == 0 || off >= s->capacity || len > s->capacity - off)
        return isw_fail(ERANGE, "region [%" PRIu64 ", +%" PRIu64 ") is outside the %" PRIu64
                        "-byte store", off, len, s->capacity);
    uint64_t i = off / s->slab_size;
    if ((off + len - 1) / s->slab_size != i)
        return isw_fail(ERANGE, "region [%" PRIu64 ", +%" PRIu64 ") crosses a slab boundary",
                        off, len);
    if (atomic_load(&s->slot[i]) == SLOT_FREE)
        return isw_fail(EFAULT, "region offset %" PRIu64 " is in slab %" PRIu64
                        ", which is not allocated", off, i);
    return 0;
}

int isw_store_read(struct isw_store *s, uint64_t off, void *buf, uint64_t len)
{
    int rc = st_enter(s);
    if (rc < 0)
        return rc;
    rc = isw_store_check_region(s, off, len);
    if (rc == 0)
        memcpy(buf, s->base + off, len);
    st_leave(s);
    return rc;
}

int isw_store_write(struct isw_store *s, uint64_t off, const void *buf, uint64_t len)
{
    int rc = st_enter(s);
    if (rc < 0)
        return rc;
    rc = isw_store_check_region(s, off, len);
    if (rc == 0)
        memcpy(s->base + off, buf, len);
    st_leave(s);
    return rc;
}
