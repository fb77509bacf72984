/*
 * isw_store.c — the daemon's slab store (see isw_store.h).
 *
 * Owns: the memfd and its mapping, the slot states, the fence lines of the slabs
 * (isw_fence.h), the allocated/locked counts and the store's lifetime (closed and freed
 * only once no data server uses it).
 *
 * The memfd is sized to the full capacity plus the fence area up front (sparse: tmpfs
 * allocates nothing until a slab is fallocated) and never shrinks, so a device's MAP_SHARED
 * mapping of it never faults.  Slot states are atomics so the data server can validate
 * regions without a lock.  State changes serialize on the store mutex, but the slow parts
 * (fallocate + mlock of a new slab, munlock + hole punching of a freed one) run with the
 * mutex released: the slot is first moved to ALLOCATING / FREEING under the mutex, which
 * keeps every other caller off it, and published as allocated / free afterwards.
 */
#include "isw_store.h"
#include "isw_common.h"
#include "isw_fence.h"

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
#define SLOT_ALLOCATING 1       /* reserved; memory being allocated without the mutex */
#define SLOT_ALLOC 2
#define SLOT_LOCKED 3
#define SLOT_FREEING 4          /* revoked; memory being released without the mutex */

#define FREE_DRAIN_POLL_US 10
#define FREE_DRAIN_TRIES 10000  /* free_slab waits up to ~0.1 s for accesses in progress */

struct isw_store {
    int fd;
    unsigned char *base;
    uint64_t capacity, slab_size, file_size;
    uint32_t nslots;
    _Atomic unsigned char *slot;
    struct isw_fence_line *lines;   /* in the memfd, right after the slabs */
    uint32_t nalloc, nlocked;       /* under mu */
    pthread_mutex_t mu;
    _Atomic int64_t ops;
    atomic_int closed;
    int users;                      /* data servers; under mu */
    int free_requested;             /* under mu */
    atomic_int debug_hold;          /* test hook: how many more allocations to hold */
    atomic_int debug_held;          /* allocations waiting in the hook */
    atomic_int debug_released;      /* bumped when the holds are released */
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

static int slot_allocated(int st)
{
    return st == SLOT_ALLOC || st == SLOT_LOCKED;
}

/* The fence area (lines, padding, footer): resident from open on, never punched.  It is not
 * mlocked here, so that RLIMIT_MEMLOCK stays for the slabs; a hardened daemon's
 * mlockall(MCL_FUTURE | MCL_ONFAULT) locks it, and its lines are touched on every access. */
static uint64_t fence_bytes(struct isw_store *s)
{
    return s->file_size - s->capacity;
}

/* Allocate and describe the fence area of a new store's memfd. */
static int init_fence(struct isw_store *s)
{
    if (fallocate(s->fd, 0, (off_t)s->capacity, (off_t)fence_bytes(s)) < 0)
        return -errno;
    struct isw_fence_footer *f =
        (struct isw_fence_footer *)(s->base + s->file_size - ISW_FENCE_FOOTER_SIZE);
    f->slab_size = s->slab_size;
    f->capacity = s->capacity;
    f->nslots = s->nslots;
    f->version = ISW_FENCE_VERSION;
    f->magic = ISW_FENCE_MAGIC;     /* devices learn the path only later, through MR_INFO */
    s->lines = (struct isw_fence_line *)(s->base + s->capacity);
    return 0;
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
    s->file_size = isw_fence_file_size(capacity, s->nslots);
    s->base = MAP_FAILED;
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
    if (ftruncate(s->fd, (off_t)s->file_size) < 0) {
        rc = -errno;
        goto fail;
    }
    s->base = mmap(NULL, s->file_size, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
    if (s->base == MAP_FAILED) {
        rc = -errno;
        goto fail;
    }
    if ((rc = init_fence(s)) < 0)
        goto fail;
    pthread_mutex_init(&s->mu, NULL);
    *out = s;
    return 0;
fail:
    if (s->base != MAP_FAILED)
        munmap(s->base, s->file_size);
    if (s->fd >= 0)
        close(s->fd);
    free((void *)s->slot);
    free(s);
    return isw_fail(-rc, "cannot create the %" PRIu64 "-byte slab memfd: %s", capacity,
                    isw_strerror(rc));
}

static void really_close(struct isw_store *s)
{
    munmap(s->base, s->file_size);
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

/* Under mu: the error for a failed mlock of a slab (rc = -errno). */
static int mlock_failed(struct isw_store *s, int rc)
{
    char lim[64];

    format_memlock(lim, sizeof lim);
    return isw_fail(-rc, "mlock of a %" PRIu64 "-byte slab failed: %s (RLIMIT_MEMLOCK is %s, "
                    "%u slabs already locked); raise the limit (ulimit -l, LimitMEMLOCK=) or "
                    "allocate with lock=False", s->slab_size, isw_strerror(rc), lim, s->nlocked);
}

static void punch(struct isw_store *s, uint64_t off, int *rc)
{
    if (fallocate(s->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)off,
                  (off_t)s->slab_size) < 0 && rc != NULL) {
        *rc = -errno;
        *rc = isw_fail(-*rc, "cannot release slab memory at %" PRIu64 ": %s", off,
                       isw_strerror(*rc));
    }
}

/* The test hook of isw_store_debug_hold_allocations: take a hold token if there is one,
 * then wait until the holds are released. */
static void debug_hold_point(struct isw_store *s)
{
    int released = atomic_load(&s->debug_released);     /* before the token: see the header */
    int n = atomic_load(&s->debug_hold);

    while (n > 0 && !atomic_compare_exchange_weak(&s->debug_hold, &n, n - 1))
        ;
    if (n <= 0)
        return;
    atomic_fetch_add(&s->debug_held, 1);
    while (atomic_load(&s->debug_released) == released)
        isw_sleep_us(200);
    atomic_fetch_sub(&s->debug_held, 1);
}

/* Without the mutex: give the reserved slot at `off` its memory (and lock it). */
static int fill_slot(struct isw_store *s, uint64_t off, int lock)
{
    int rc;

    if (fallocate(s->fd, 0, (off_t)off, (off_t)s->slab_size) < 0) {
        rc = -errno;
        return isw_fail(-rc, "cannot allocate %" PRIu64 " bytes of slab memory: %s",
                        s->slab_size, isw_strerror(rc));
    }
    if (lock && mlock(s->base + off, s->slab_size) < 0) {
        rc = -errno;
        punch(s, off, NULL);
        pthread_mutex_lock(&s->mu);
        rc = mlock_failed(s, rc);
        pthread_mutex_unlock(&s->mu);
        return rc;
    }
    return 0;
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
        pthread_mutex_unlock(&s->mu);
        st_leave(s);
        return rc;
    }
    atomic_store(&s->slot[i], SLOT_ALLOCATING);     /* ours: nobody else takes or frees it */
    pthread_mutex_unlock(&s->mu);

    uint64_t off = (uint64_t)i * s->slab_size;
    debug_hold_point(s);
    rc = fill_slot(s, off, lock);

    pthread_mutex_lock(&s->mu);
    if (rc < 0) {
        atomic_store(&s->slot[i], SLOT_FREE);
    } else {
        atomic_fetch_add(&s->lines[i].gen, 1);      /* a new life: no older lease matches */
        atomic_store(&s->slot[i], lock ? SLOT_LOCKED : SLOT_ALLOC);
        s->nalloc++;
        if (lock)
            s->nlocked++;
        *region_offset = off;
    }
    pthread_mutex_unlock(&s->mu);
    st_leave(s);
    return rc;
}

/* The slot of an allocated slab at `off`, or -EINVAL with a message. */
static int allocated_slot(struct isw_store *s, uint64_t off, uint32_t *slot)
{
    uint64_t i = off / s->slab_size;

    if (off % s->slab_size != 0 || i >= s->nslots || !slot_allocated(atomic_load(&s->slot[i])))
        return isw_fail(EINVAL, "region offset %" PRIu64 " is not an allocated slab", off);
    *slot = (uint32_t)i;
    return 0;
}

static int drained(struct isw_store *s, uint32_t i)
{
    return atomic_load(&s->lines[i].users) == 0;
}

int isw_store_free_slab(struct isw_store *s, uint64_t region_offset)
{
    uint32_t i = 0;
    int rc = st_enter(s);
    if (rc < 0)
        return rc;
    pthread_mutex_lock(&s->mu);
    if ((rc = allocated_slot(s, region_offset, &i)) < 0) {
        pthread_mutex_unlock(&s->mu);
        st_leave(s);
        return rc;
    }
    int st = atomic_exchange(&s->slot[i], SLOT_FREEING);
    pthread_mutex_unlock(&s->mu);

    atomic_fetch_add(&s->lines[i].gen, 1);          /* no access starts any more */
    for (int t = 0; t < FREE_DRAIN_TRIES && !drained(s, i); t++)
        isw_sleep_us(FREE_DRAIN_POLL_US);
    if (!drained(s, i)) {
        atomic_store(&s->slot[i], (unsigned char)st);
        st_leave(s);
        return isw_fail(EBUSY, "slab at region offset %" PRIu64 " is still being accessed; "
                        "it stays allocated (revoked)", region_offset);
    }
    if (st == SLOT_LOCKED)
        munlock(s->base + region_offset, s->slab_size);
    punch(s, region_offset, &rc);

    pthread_mutex_lock(&s->mu);
    atomic_store(&s->slot[i], SLOT_FREE);
    s->nalloc--;
    if (st == SLOT_LOCKED)
        s->nlocked--;
    pthread_mutex_unlock(&s->mu);
    st_leave(s);
    return rc;
}

/* st_enter, then find the slot of the slab at `off` (allocated or not: `allocated`): 0 with
 * the store entered, or -EBADF / -EINVAL with nothing held. */
static int slot_enter(struct isw_store *s, uint64_t off, int allocated, uint32_t *slot)
{
    int rc = st_enter(s);
    if (rc < 0)
        return rc;
    if (allocated)
        rc = allocated_slot(s, off, slot);
    else if (off % s->slab_size != 0 || off / s->slab_size >= s->nslots)
        rc = isw_fail(EINVAL, "region offset %" PRIu64 " is not a slab of the store", off);
    else
        *slot = (uint32_t)(off / s->slab_size);
    if (rc < 0)
        st_leave(s);
    return rc;
}

/* The lent slab at region_offset: its address and/or its generation (either may be NULL). */
static int slab_lookup(struct isw_store *s, uint64_t region_offset, uint64_t *addr, uint64_t *gen)
{
    uint32_t i = 0;
    int rc = slot_enter(s, region_offset, 1, &i);
    if (rc < 0)
        return rc;
    if (addr)
        *addr = (uint64_t)(uintptr_t)(s->base + region_offset);
    if (gen)
        *gen = atomic_load(&s->lines[i].gen);
    st_leave(s);
    return 0;
}

int isw_store_slab_address(struct isw_store *s, uint64_t region_offset, uint64_t *addr)
{
    return slab_lookup(s, region_offset, addr, NULL);
}

int isw_store_slab_generation(struct isw_store *s, uint64_t region_offset, uint64_t *gen)
{
    return slab_lookup(s, region_offset, NULL, gen);
}

int isw_store_revoke_slab(struct isw_store *s, uint64_t region_offset)
{
    uint32_t i = 0;
    int rc = slot_enter(s, region_offset, 1, &i);
    if (rc < 0)
        return rc;
    atomic_fetch_add(&s->lines[i].gen, 1);
    rc = drained(s, i);
    st_leave(s);
    return rc;
}

int isw_store_slab_drained(struct isw_store *s, uint64_t region_offset)
{
    uint32_t i = 0;
    int rc = slot_enter(s, region_offset, 0, &i);
    if (rc < 0)
        return rc;
    rc = drained(s, i);
    st_leave(s);
    return rc;
}

int isw_store_reset_slab_users(struct isw_store *s, uint64_t region_offset)
{
    uint32_t i = 0;
    int rc = slot_enter(s, region_offset, 0, &i);
    if (rc < 0)
        return rc;
    atomic_store(&s->lines[i].users, 0);
    st_leave(s);
    return 0;
}

int isw_store_debug_hold_allocations(struct isw_store *s, int n)
{
    if (n < 0)
        return isw_fail(EINVAL, "cannot hold %d allocations", n);
    if (n == 0) {
        atomic_store(&s->debug_hold, 0);
        atomic_fetch_add(&s->debug_released, 1);
    } else {
        atomic_store(&s->debug_hold, n);
    }
    return 0;
}

int isw_store_debug_allocations_held(struct isw_store *s)
{
    return atomic_load(&s->debug_held);
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
        uint64_t blocks = (uint64_t)st.st_blocks * 512u;     /* the fence area is resident */
        *out = blocks > fence_bytes(s) ? blocks - fence_bytes(s) : 0;
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
    if (!slot_allocated(atomic_load(&s->slot[i])))
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

int isw_store_access_with(struct isw_store *s, uint64_t off, uint64_t len, uint64_t gen,
                          int (*fn)(unsigned char *mem, uint64_t len, void *arg), void *arg)
{
    int rc = isw_store_check_region(s, off, len);
    if (rc < 0)
        return rc;
    uint64_t i = off / s->slab_size;
    struct isw_fence_line *l = &s->lines[i];
    if (isw_fence_enter(l, gen) < 0)
        return isw_fail(ESTALE, "slab %" PRIu64 " was taken back: generation %" PRIu64
                        " is no longer valid (now %" PRIu64 ")", i, gen, atomic_load(&l->gen));
    rc = fn(s->base + off, len, arg);
    isw_fence_leave(l);
    return rc;
}

struct copy_arg {
    void *buf;
    int write;
};

static int copy_region(unsigned char *mem, uint64_t len, void *arg)
{
    struct copy_arg *a = arg;
    if (a->write)
        memcpy(mem, a->buf, len);
    else
        memcpy(a->buf, mem, len);
    return 0;
}

int isw_store_access(struct isw_store *s, uint64_t off, uint64_t len, uint64_t gen, void *buf,
                     int write)
{
    struct copy_arg a = { buf, write };
    return isw_store_access_with(s, off, len, gen, copy_region, &a);
}
