/*
 * isw_device.c — the device: slab table, page bitmap ("valid in remote"), counters and the
 * I/O router (thesis §2.4.1, §2.4.3–§2.4.5).
 *
 * Owns: the slab table and bitmap, the remotes (by id), the control mutex, the per-slab
 * counters and the backup file handle (isw_backup.c does its I/O).
 *
 * Invariants
 *  - Every write reaches the backup file (sync when unmapped/failed, async after a remote
 *    write), so the disk, once a slab's pending writes are done, always holds the data.
 *  - A page bit is set only right after a successful remote write of that page in the
 *    current mapping; bits are cleared on map, on failure and after an eviction drained.
 *  - Remote I/O only happens inside the slab's in-flight window: in_flight++ then a state
 *    check (both seq_cst).  Eviction stores EVICTING and then waits for in_flight == 0, so
 *    after the wait no thread touches the remote region (Dekker-style handshake).
 *  - A failed remote I/O moves the slab MAPPED → EVICTING (no new remote I/O), flags it and
 *    clears its bits; the data is then served from disk.  The control loop unmaps it.  This
 *    includes an access the daemon's fence refused (-ESTALE: the daemon took the slab back
 *    while this device was too slow to hear of it).
 *
 * Call guard: every public call but the size getters, close and free runs between dev_enter
 * and dev_leave, so close() can wait for the calls in progress.  A control call that needs
 * the control mutex and a slab or remote takes all of it with one acquire helper
 * (ctl_acquire, slab_acquire, remote_acquire) and gives it back with ctl_release.
 */
#include "isw_device.h"
#include "isw_backup.h"
#include "isw_common.h"
#include "isw_rdma.h"
#include "isw_remote.h"

#include <errno.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct isw_slab {
    _Alignas(64) atomic_int state;
    atomic_int failed;
    _Atomic int64_t in_flight;
    _Atomic uint64_t activity;
    /* Written under the control mutex while no I/O can read them (see invariants). */
    struct isw_remote *remote;
    int remote_id;
    uint64_t region_offset;
    uint64_t gen;                   /* the generation of the daemon's lease (isw_fence.h) */
    _Atomic uint64_t rd_remote, wr_remote, rd_disk, wr_disk_sync;
};

struct isw_device {
    uint64_t size, slab_size;
    uint32_t nslabs;
    uint32_t words_per_slab;
    struct isw_slab *slabs;
    _Atomic uint64_t *bits;
    struct isw_backup *backup;
    pthread_mutex_t ctl;
    struct isw_remote **remotes;    /* indexed by id; NULL once removed; under ctl */
    int nremotes, remotes_cap;
    _Atomic uint64_t remote_errors;
    _Atomic int64_t ops;            /* calls in progress */
    atomic_int closed;
    int close_rc;
};

static const char *state_name(int st)
{
    static const char *names[] = { "unmapped", "mapping", "mapped", "evicting" };
    return (st >= 0 && st < 4) ? names[st] : "?";
}

/* ---------- call guard ---------- */

static int dev_enter(struct isw_device *d)
{
    atomic_fetch_add(&d->ops, 1);
    if (atomic_load(&d->closed)) {
        atomic_fetch_sub(&d->ops, 1);
        return isw_fail(EBADF, "device is closed");
    }
    return 0;
}

static void dev_leave(struct isw_device *d)
{
    atomic_fetch_sub(&d->ops, 1);
}

/* Enter the device and take the control mutex: 0, or -EBADF (closed) with nothing held. */
static int ctl_acquire(struct isw_device *d)
{
    int rc = dev_enter(d);
    if (rc < 0)
        return rc;
    pthread_mutex_lock(&d->ctl);
    return 0;
}

/* Undo a successful ctl_acquire, slab_acquire or remote_acquire. */
static void ctl_release(struct isw_device *d)
{
    pthread_mutex_unlock(&d->ctl);
    dev_leave(d);
}

static int check_slab(struct isw_device *d, uint32_t slab)
{
    if (slab >= d->nslabs)
        return isw_fail(ERANGE, "slab %u is out of range: the device has %u slabs", slab,
                        d->nslabs);
    return 0;
}

/* Check the slab number, then ctl_acquire: the slab, held under the control mutex, or NULL
 * with *rc set (-ERANGE, -EBADF) and nothing held. */
static struct isw_slab *slab_acquire(struct isw_device *d, uint32_t slab, int *rc)
{
    if ((*rc = check_slab(d, slab)) < 0 || (*rc = ctl_acquire(d)) < 0)
        return NULL;
    return &d->slabs[slab];
}

/* Under ctl. */
static struct isw_remote *find_remote(struct isw_device *d, int id, int *rc)
{
    if (id < 0 || id >= d->nremotes || d->remotes[id] == NULL) {
        *rc = isw_fail(ENOENT, "no remote with id %d", id);
        return NULL;
    }
    *rc = 0;
    return d->remotes[id];
}

/* ctl_acquire, then find the remote: it is returned under the control mutex, or NULL with
 * *rc set (-EBADF, -ENOENT) and nothing held. */
static struct isw_remote *remote_acquire(struct isw_device *d, int id, int *rc)
{
    if ((*rc = ctl_acquire(d)) < 0)
        return NULL;
    struct isw_remote *r = find_remote(d, id, rc);
    if (r == NULL)
        ctl_release(d);
    return r;
}

/* ---------- bitmap ---------- */

static _Atomic uint64_t *slab_bits(struct isw_device *d, uint32_t si)
{
    return d->bits + (size_t)si * d->words_per_slab;
}

static void bits_set(struct isw_device *d, uint32_t si, uint64_t first, uint64_t n)
{
    _Atomic uint64_t *w = slab_bits(d, si);

    while (n > 0) {
        uint64_t idx = first >> 6, b = first & 63;
        uint64_t take = 64 - b < n ? 64 - b : n;
        uint64_t mask = take == 64 ? ~(uint64_t)0 : (((uint64_t)1 << take) - 1) << b;
        atomic_fetch_or(&w[idx], mask);
        first += take;
        n -= take;
    }
}

static int bit_test(struct isw_device *d, uint32_t si, uint64_t page)
{
    return (int)((atomic_load(&slab_bits(d, si)[page >> 6]) >> (page & 63)) & 1);
}

static void bits_clear(struct isw_device *d, uint32_t si)
{
    _Atomic uint64_t *w = slab_bits(d, si);
    for (uint32_t i = 0; i < d->words_per_slab; i++)
        atomic_store(&w[i], 0);
}

static uint64_t bits_count(struct isw_device *d, uint32_t si)
{
    _Atomic uint64_t *w = slab_bits(d, si);
    uint64_t n = 0;
    for (uint32_t i = 0; i < d->words_per_slab; i++)
        n += (uint64_t)__builtin_popcountll(atomic_load(&w[i]));
    return n;
}

/* ---------- open / close ---------- */

int isw_device_open(uint64_t size, uint64_t slab_size, const char *backup_path,
                    int writer_threads, uint64_t pending_cap, struct isw_device **out)
{
    int rc;

    if (!isw_is_pow2(slab_size) || slab_size < ISW_MIN_SLAB_SIZE)
        return isw_fail(EINVAL, "slab_size %" PRIu64 " must be a power of two >= %" PRIu64,
                        slab_size, ISW_MIN_SLAB_SIZE);
    if (size == 0 || size % slab_size != 0)
        return isw_fail(EINVAL, "size %" PRIu64 " must be a positive multiple of slab_size %"
                        PRIu64, size, slab_size);
    if (size / slab_size > UINT32_MAX)
        return isw_fail(EINVAL, "size %" PRIu64 " has too many slabs", size);
    if (backup_path == NULL || backup_path[0] == '\0')
        return isw_fail(EINVAL, "a backup file path is required");
    if (pending_cap == 0)
        pending_cap = ISW_DEFAULT_PENDING_CAP;

    struct isw_device *d = calloc(1, sizeof *d);
    if (d == NULL)
        return isw_fail(ENOMEM, "out of memory");
    d->size = size;
    d->slab_size = slab_size;
    d->nslabs = (uint32_t)(size / slab_size);
    d->words_per_slab = (uint32_t)((slab_size >> ISW_PAGE_SHIFT) / 64);
    d->slabs = aligned_alloc(64, sizeof(struct isw_slab) * d->nslabs);
    d->bits = calloc((size_t)d->nslabs * d->words_per_slab, sizeof(uint64_t));
    if (d->slabs == NULL || d->bits == NULL) {
        free(d->slabs);
        free(d->bits);
        free(d);
        return isw_fail(ENOMEM, "out of memory for %" PRIu64 " slabs", size / slab_size);
    }
    memset(d->slabs, 0, sizeof(struct isw_slab) * d->nslabs);
    for (uint32_t i = 0; i < d->nslabs; i++)
        d->slabs[i].remote_id = -1;
    rc = isw_backup_open(backup_path, size, d->nslabs, writer_threads, pending_cap, &d->backup);
    if (rc < 0) {
        free(d->slabs);
        free(d->bits);
        free(d);
        return rc;
    }
    pthread_mutex_init(&d->ctl, NULL);
    *out = d;
    return 0;
}

int isw_device_close(struct isw_device *d)
{
    if (atomic_exchange(&d->closed, 1))
        return 0;
    while (atomic_load(&d->ops) != 0)
        isw_sleep_us(50);
    pthread_mutex_lock(&d->ctl);
    d->close_rc = isw_backup_close(d->backup);
    d->backup = NULL;
    for (int i = 0; i < d->nremotes; i++)
        if (d->remotes[i] != NULL) {
            d->remotes[i]->ops->destroy(d->remotes[i]);
            d->remotes[i] = NULL;
        }
    for (uint32_t i = 0; i < d->nslabs; i++) {
        d->slabs[i].remote = NULL;
        atomic_store(&d->slabs[i].state, ISW_SLAB_UNMAPPED);
    }
    pthread_mutex_unlock(&d->ctl);
    return d->close_rc;
}

void isw_device_free(struct isw_device *d)
{
    if (d == NULL)
        return;
    isw_device_close(d);
    pthread_mutex_destroy(&d->ctl);
    free(d->remotes);
    free(d->slabs);
    free(d->bits);
    free(d);
}

uint64_t isw_device_size(struct isw_device *d) { return d->size; }
uint64_t isw_device_slab_size(struct isw_device *d) { return d->slab_size; }
uint32_t isw_device_num_slabs(struct isw_device *d) { return d->nslabs; }

/* ---------- I/O path ---------- */

static int check_range(struct isw_device *d, const char *what, uint64_t off, uint64_t len)
{
    if (off % ISW_PAGE_SIZE != 0)
        return isw_fail(EINVAL, "%s: offset %" PRIu64 " is not a multiple of the %u-byte page",
                        what, off, ISW_PAGE_SIZE);
    if (len % ISW_PAGE_SIZE != 0)
        return isw_fail(EINVAL, "%s: length %" PRIu64 " is not a multiple of the %u-byte page",
                        what, len, ISW_PAGE_SIZE);
    if (off > d->size || len > d->size - off)
        return isw_fail(ERANGE, "%s: range [%" PRIu64 ", %" PRIu64 ") is out of range: the "
                        "device is %" PRIu64 " bytes", what, off, off + len, d->size);
    return 0;
}

/* A remote I/O of slab si failed: stop remote I/O on it, flag it for the control loop. */
static void slab_fail(struct isw_device *d, uint32_t si)
{
    struct isw_slab *s = &d->slabs[si];
    int expected = ISW_SLAB_MAPPED;

    atomic_fetch_add(&d->remote_errors, 1);
    atomic_store(&s->failed, 1);
    atomic_compare_exchange_strong(&s->state, &expected, ISW_SLAB_EVICTING);
    bits_clear(d, si);
}

/* Remote usable for slab s?  Call inside the in-flight window; returns the remote or NULL. */
static struct isw_remote *slab_remote(struct isw_slab *s)
{
    if (atomic_load(&s->state) != ISW_SLAB_MAPPED)
        return NULL;
    struct isw_remote *r = s->remote;
    return atomic_load(&r->dead) ? NULL : r;
}

static int write_piece(struct isw_device *d, uint32_t si, uint64_t soff,
                       const unsigned char *buf, uint64_t len)
{
    struct isw_slab *s = &d->slabs[si];
    uint64_t dev_off = (uint64_t)si * d->slab_size + soff;
    int rc;

    atomic_fetch_add(&s->activity, len >> ISW_PAGE_SHIFT);
    atomic_fetch_add(&s->in_flight, 1);
    struct isw_remote *r = slab_remote(s);
    if (r != NULL) {
        rc = r->ops->write(r, s->region_offset + soff, s->gen, buf, len);
        if (rc == 0) {
            bits_set(d, si, soff >> ISW_PAGE_SHIFT, len >> ISW_PAGE_SHIFT);
            atomic_fetch_add(&s->wr_remote, len);
            atomic_fetch_add(&r->bytes_written, len);
            atomic_fetch_sub(&s->in_flight, 1);
            /* Queued before write() returns, so any later read of the slab waits for it. */
            return isw_backup_write_async(d->backup, si, dev_off, buf, len);
        }
        slab_fail(d, si);
    }
    atomic_fetch_sub(&s->in_flight, 1);
    rc = isw_backup_write_sync(d->backup, si, dev_off, buf, len);
    if (rc == 0)
        atomic_fetch_add(&s->wr_disk_sync, len);
    return rc;
}

static int disk_read(struct isw_device *d, uint32_t si, uint64_t dev_off, unsigned char *buf,
                     uint64_t len)
{
    int rc = isw_backup_read(d->backup, si, dev_off, buf, len);
    if (rc == 0)
        atomic_fetch_add(&d->slabs[si].rd_disk, len);
    return rc;
}

static int read_piece(struct isw_device *d, uint32_t si, uint64_t soff, unsigned char *buf,
                      uint64_t len)
{
    struct isw_slab *s = &d->slabs[si];
    uint64_t dev_off = (uint64_t)si * d->slab_size + soff;
    uint64_t first = soff >> ISW_PAGE_SHIFT, npages = len >> ISW_PAGE_SHIFT;
    int rc = 0;

    atomic_fetch_add(&s->activity, npages);
    atomic_fetch_add(&s->in_flight, 1);
    struct isw_remote *r = slab_remote(s);
    if (r == NULL) {
        atomic_fetch_sub(&s->in_flight, 1);
        return disk_read(d, si, dev_off, buf, len);
    }
    uint64_t base = s->region_offset;
    for (uint64_t p = 0; p < npages;) {
        int bit = bit_test(d, si, first + p);
        uint64_t run = 1;
        while (p + run < npages && bit_test(d, si, first + p + run) == bit)
            run++;
        uint64_t o = p << ISW_PAGE_SHIFT, n = run << ISW_PAGE_SHIFT;
        if (bit) {
            rc = r->ops->read(r, base + soff + o, s->gen, buf + o, n);
            if (rc < 0) {
                slab_fail(d, si);
                atomic_fetch_sub(&s->in_flight, 1);
                return disk_read(d, si, dev_off + o, buf + o, len - o);
            }
            atomic_fetch_add(&s->rd_remote, n);
            atomic_fetch_add(&r->bytes_read, n);
        } else {
            rc = disk_read(d, si, dev_off + o, buf + o, n);
            if (rc < 0)
                break;
        }
        p += run;
    }
    atomic_fetch_sub(&s->in_flight, 1);
    return rc;
}

/* One I/O over [off, off+len): split at slab boundaries (a request may span slabs, some
 * mapped and some not, §2.4.3) and run each piece; the first error ends it. ``wbuf`` is the
 * source of a write, ``rbuf`` the destination of a read (exactly one is non-NULL). */
static int for_each_piece(struct isw_device *d, const char *what, uint64_t off, const unsigned char *wbuf,
                          unsigned char *rbuf, uint64_t len)
{
    int rc = check_range(d, what, off, len);

    if (rc < 0)
        return rc;
    if ((rc = dev_enter(d)) < 0)
        return rc;
    while (len > 0) {
        uint32_t si = (uint32_t)(off / d->slab_size);
        uint64_t soff = off % d->slab_size;
        uint64_t n = d->slab_size - soff < len ? d->slab_size - soff : len;
        if (wbuf) {
            rc = write_piece(d, si, soff, wbuf, n);
            wbuf += n;
        } else {
            rc = read_piece(d, si, soff, rbuf, n);
            rbuf += n;
        }
        if (rc < 0)
            break;
        off += n;
        len -= n;
    }
    dev_leave(d);
    return rc;
}

int isw_device_write(struct isw_device *d, uint64_t off, const void *buf, uint64_t len)
{
    return for_each_piece(d, "write", off, buf, NULL, len);
}

int isw_device_read(struct isw_device *d, uint64_t off, void *buf, uint64_t len)
{
    return for_each_piece(d, "read", off, NULL, buf, len);
}

int isw_device_flush(struct isw_device *d)
{
    int rc = dev_enter(d);
    if (rc < 0)
        return rc;
    rc = isw_backup_flush(d->backup);
    dev_leave(d);
    return rc;
}

/* ---------- remotes ---------- */

static int add_remote(struct isw_device *d, struct isw_remote *r)
{
    int id;

    pthread_mutex_lock(&d->ctl);
    if (d->nremotes == d->remotes_cap) {
        int cap = d->remotes_cap ? d->remotes_cap * 2 : 16;
        struct isw_remote **nr = realloc(d->remotes, sizeof *nr * (size_t)cap);
        if (nr == NULL) {
            pthread_mutex_unlock(&d->ctl);
            r->ops->destroy(r);
            return isw_fail(ENOMEM, "out of memory");
        }
        d->remotes = nr;
        d->remotes_cap = cap;
    }
    id = d->nremotes++;
    r->id = id;
    d->remotes[id] = r;
    pthread_mutex_unlock(&d->ctl);
    return id;
}

int isw_device_add_remote_shm(struct isw_device *d, const char *path, uint64_t size)
{
    struct isw_remote *r;
    int rc = dev_enter(d);

    if (rc < 0)
        return rc;
    rc = isw_remote_shm_open(path, size, &r);
    if (rc == 0)
        rc = add_remote(d, r);
    dev_leave(d);
    return rc;
}

int isw_device_add_remote_tcp(struct isw_device *d, const char *host, int port,
                              int connections, int timeout_ms, int rto_min_us,
                              const unsigned char *key, size_t key_len)
{
    struct isw_remote *r;
    int rc = dev_enter(d);

    if (rc < 0)
        return rc;
    rc = isw_remote_tcp_open(host, port, connections, timeout_ms, rto_min_us, key, key_len, &r);
    if (rc == 0)
        rc = add_remote(d, r);
    dev_leave(d);
    return rc;
}

int isw_device_add_remote_rdma(struct isw_device *d, struct isw_rdma_qp *q, uint64_t nslots)
{
    struct isw_remote *r;
    int rc = dev_enter(d);

    if (rc < 0) {
        isw_rdma_qp_destroy(q);
        return rc;
    }
    rc = isw_remote_rdma_open(q, nslots, d->slab_size, &r);    /* takes q over */
    if (rc == 0)
        rc = add_remote(d, r);
    dev_leave(d);
    return rc;
}

int isw_device_set_rdma_slab(struct isw_device *d, int remote_id, uint64_t region_offset,
                             uint64_t generation, uint64_t addr, uint32_t rkey)
{
    int rc;
    struct isw_remote *r = remote_acquire(d, remote_id, &rc);

    if (r == NULL)
        return rc;
    if (region_offset % d->slab_size != 0)
        rc = isw_fail(EINVAL, "region offset %" PRIu64 " is not slab aligned", region_offset);
    else
        rc = isw_remote_rdma_set_slab(r, region_offset / d->slab_size, generation, addr, rkey);
    ctl_release(d);
    return rc;
}

/* Under ctl.  Returns 1 if the slab was mapped (or evicting), 0 if there was nothing. */
static int evict_locked(struct isw_device *d, uint32_t si)
{
    struct isw_slab *s = &d->slabs[si];
    int st = atomic_load(&s->state);

    if (st == ISW_SLAB_UNMAPPED)
        return 0;
    if (st == ISW_SLAB_MAPPING) {
        atomic_store(&s->state, ISW_SLAB_UNMAPPED);
        return 0;
    }
    atomic_store(&s->state, ISW_SLAB_EVICTING);     /* new I/O goes to disk */
    bits_clear(d, si);
    while (atomic_load(&s->in_flight) != 0)         /* thesis §2.4.4: poll every 10 us */
        isw_sleep_us(10);
    bits_clear(d, si);          /* again: a remote write in flight may have set some */
    if (s->remote != NULL)
        s->remote->nslabs--;
    s->remote = NULL;
    s->remote_id = -1;
    s->region_offset = 0;
    s->gen = 0;
    atomic_store(&s->failed, 0);
    atomic_store(&s->state, ISW_SLAB_UNMAPPED);
    return 1;
}

static int unmap_remote_locked(struct isw_device *d, struct isw_remote *r)
{
    int n = 0;
    for (uint32_t i = 0; i < d->nslabs && r->nslabs > 0; i++)
        if (d->slabs[i].remote == r)
            n += evict_locked(d, i);
    return n;
}

int isw_device_remove_remote(struct isw_device *d, int remote_id)
{
    int rc;
    struct isw_remote *r = remote_acquire(d, remote_id, &rc);

    if (r == NULL)
        return rc;
    unmap_remote_locked(d, r);
    d->remotes[remote_id] = NULL;
    r->ops->destroy(r);
    ctl_release(d);
    return 0;
}

int isw_device_mark_remote_dead(struct isw_device *d, int remote_id)
{
    int rc;
    struct isw_remote *r = remote_acquire(d, remote_id, &rc);

    if (r == NULL)
        return rc;
    isw_remote_error(r, 1, EHOSTDOWN, "marked dead by the control loop");
    ctl_release(d);
    return 0;
}

int isw_device_remote_dead(struct isw_device *d, int remote_id)
{
    int rc;
    struct isw_remote *r = remote_acquire(d, remote_id, &rc);

    if (r == NULL)
        return rc;
    rc = atomic_load(&r->dead) ? 1 : 0;
    ctl_release(d);
    return rc;
}

int isw_device_remote_rto_min_us(struct isw_device *d, int remote_id)
{
    int rc;
    struct isw_remote *r = remote_acquire(d, remote_id, &rc);

    if (r == NULL)
        return rc;
    rc = r->rto_min_us;
    ctl_release(d);
    return rc;
}

int isw_device_remote_bytes(struct isw_device *d, int remote_id, uint64_t *bytes_read,
                            uint64_t *bytes_written)
{
    int rc;
    struct isw_remote *r = remote_acquire(d, remote_id, &rc);

    if (r == NULL)
        return rc;
    *bytes_read = atomic_load(&r->bytes_read);
    *bytes_written = atomic_load(&r->bytes_written);
    ctl_release(d);
    return 0;
}

int isw_device_remote_error(struct isw_device *d, int remote_id, char *out, size_t n)
{
    int rc;
    struct isw_remote *r = remote_acquire(d, remote_id, &rc);

    if (r == NULL)
        return rc;
    isw_remote_last_error(r, out, n);
    ctl_release(d);
    return 0;
}

/* ---------- mapping control ---------- */

int isw_device_begin_map(struct isw_device *d, uint32_t slab)
{
    int rc;
    struct isw_slab *s = slab_acquire(d, slab, &rc);

    if (s == NULL)
        return rc;
    int st = atomic_load(&s->state);
    if (st == ISW_SLAB_UNMAPPED)
        atomic_store(&s->state, ISW_SLAB_MAPPING);
    else
        rc = isw_fail(EBUSY, "slab %u is %s, not unmapped", slab, state_name(st));
    ctl_release(d);
    return rc;
}

int isw_device_abort_map(struct isw_device *d, uint32_t slab)
{
    int rc;
    struct isw_slab *s = slab_acquire(d, slab, &rc);

    if (s == NULL)
        return rc;
    int st = atomic_load(&s->state);
    if (st == ISW_SLAB_MAPPING)
        atomic_store(&s->state, ISW_SLAB_UNMAPPED);
    else if (st != ISW_SLAB_UNMAPPED)
        rc = isw_fail(EBUSY, "slab %u is %s, not being mapped", slab, state_name(st));
    ctl_release(d);
    return rc;
}

int isw_device_map_slab(struct isw_device *d, uint32_t slab, int remote_id,
                        uint64_t region_offset, uint64_t generation)
{
    struct isw_remote *r;
    int rc;
    struct isw_slab *s = slab_acquire(d, slab, &rc);

    if (s == NULL)
        return rc;
    int st = atomic_load(&s->state);
    r = find_remote(d, remote_id, &rc);
    if (r == NULL)
        goto out;
    if (atomic_load(&r->dead)) {
        rc = isw_fail(EHOSTDOWN, "remote %d (%s) is dead", remote_id, r->desc);
        goto out;
    }
    if (region_offset % ISW_PAGE_SIZE != 0) {
        rc = isw_fail(EINVAL, "region offset %" PRIu64 " is not page aligned", region_offset);
        goto out;
    }
    if (r->size != UINT64_MAX &&
        (region_offset > r->size || d->slab_size > r->size - region_offset)) {
        rc = isw_fail(ERANGE, "region [%" PRIu64 ", +%" PRIu64 ") is outside remote %d's %"
                      PRIu64 " bytes", region_offset, d->slab_size, remote_id, r->size);
        goto out;
    }
    if (r->slab_size != 0 && (region_offset % r->slab_size != 0 || d->slab_size > r->slab_size)) {
        rc = isw_fail(EINVAL, "region [%" PRIu64 ", +%" PRIu64 ") is not inside one %" PRIu64
                      "-byte slab of remote %d", region_offset, d->slab_size, r->slab_size,
                      remote_id);
        goto out;
    }
    if (st != ISW_SLAB_UNMAPPED && st != ISW_SLAB_MAPPING) {
        rc = isw_fail(EBUSY, "slab %u is %s; evict it first", slab, state_name(st));
        goto out;
    }
    bits_clear(d, slab);
    s->remote = r;
    s->remote_id = remote_id;
    s->region_offset = region_offset;
    s->gen = generation;
    r->nslabs++;
    atomic_store(&s->failed, 0);
    atomic_store(&s->state, ISW_SLAB_MAPPED);       /* publishes remote/region (seq_cst) */
out:
    ctl_release(d);
    return rc;
}

int isw_device_begin_evict(struct isw_device *d, uint32_t slab)
{
    int rc;

    if (slab_acquire(d, slab, &rc) == NULL)
        return rc;
    rc = evict_locked(d, slab);
    ctl_release(d);
    return rc;
}

int isw_device_unmap_remote(struct isw_device *d, int remote_id)
{
    int rc;
    struct isw_remote *r = remote_acquire(d, remote_id, &rc);

    if (r == NULL)
        return rc;
    rc = unmap_remote_locked(d, r);
    ctl_release(d);
    return rc;
}

/* ---------- observation ---------- */

int isw_device_sample_activity(struct isw_device *d, uint64_t *out, uint32_t n)
{
    int rc = dev_enter(d);
    if (rc < 0)
        return rc;
    uint32_t m = n < d->nslabs ? n : d->nslabs;
    for (uint32_t i = 0; i < m; i++)
        out[i] = atomic_exchange(&d->slabs[i].activity, 0);
    dev_leave(d);
    return (int)m;
}

int isw_device_failed_slabs(struct isw_device *d, uint32_t *out, uint32_t n)
{
    int rc = ctl_acquire(d);
    uint32_t total = 0;

    if (rc < 0)
        return rc;
    for (uint32_t i = 0; i < d->nslabs; i++) {
        struct isw_slab *s = &d->slabs[i];
        int st = atomic_load(&s->state);
        if (st == ISW_SLAB_UNMAPPED || st == ISW_SLAB_MAPPING)
            continue;
        if (atomic_load(&s->failed) || (s->remote != NULL && atomic_load(&s->remote->dead))) {
            if (total < n)
                out[total] = i;
            total++;
        }
    }
    ctl_release(d);
    return (int)total;
}

int isw_device_slab_info(struct isw_device *d, uint32_t slab, struct isw_slab_info *out)
{
    int rc;
    struct isw_slab *s = slab_acquire(d, slab, &rc);

    if (s == NULL)
        return rc;
    memset(out, 0, sizeof *out);
    out->state = atomic_load(&s->state);
    out->remote_id = s->remote_id;
    out->region_offset = s->region_offset;
    out->generation = s->gen;
    out->bits_set = bits_count(d, slab);
    out->in_flight = atomic_load(&s->in_flight);
    out->failed = atomic_load(&s->failed);
    out->pending_disk_writes = isw_backup_slab_pending(d->backup, slab);
    out->bytes_read_remote = atomic_load(&s->rd_remote);
    out->bytes_written_remote = atomic_load(&s->wr_remote);
    out->bytes_read_disk = atomic_load(&s->rd_disk);
    out->bytes_written_disk = atomic_load(&s->wr_disk_sync) +
                              isw_backup_slab_async_bytes(d->backup, slab);
    ctl_release(d);
    return 0;
}

int isw_device_stats(struct isw_device *d, struct isw_device_stats *out)
{
    struct isw_backup_stats bs;
    int rc = dev_enter(d);

    if (rc < 0)
        return rc;
    memset(out, 0, sizeof *out);
    for (uint32_t i = 0; i < d->nslabs; i++) {
        struct isw_slab *s = &d->slabs[i];
        out->bytes_read_remote += atomic_load(&s->rd_remote);
        out->bytes_read_disk += atomic_load(&s->rd_disk);
        out->bytes_written_remote += atomic_load(&s->wr_remote);
        out->bytes_written_disk_sync += atomic_load(&s->wr_disk_sync);
        if (atomic_load(&s->state) == ISW_SLAB_MAPPED)
            out->slabs_mapped++;
    }
    isw_backup_get_stats(d->backup, &bs);
    out->bytes_written_disk_async = bs.async_bytes;
    out->disk_errors = bs.errors;
    out->pending_disk_bytes = bs.pending_bytes;
    out->pending_disk_writes = bs.pending_writes;
    out->remote_errors = atomic_load(&d->remote_errors);
    out->pages_read_remote = out->bytes_read_remote >> ISW_PAGE_SHIFT;
    out->pages_read_disk = out->bytes_read_disk >> ISW_PAGE_SHIFT;
    out->pages_written_remote = out->bytes_written_remote >> ISW_PAGE_SHIFT;
    out->pages_written_disk_async = out->bytes_written_disk_async >> ISW_PAGE_SHIFT;
    out->pages_written_disk_sync = out->bytes_written_disk_sync >> ISW_PAGE_SHIFT;
    dev_leave(d);
    return 0;
}

int isw_device_set_debug_writer_delay(struct isw_device *d, uint32_t us)
{
    int rc = dev_enter(d);
    if (rc < 0)
        return rc;
    isw_backup_set_delay_us(d->backup, us);
    dev_leave(d);
    return 0;
}
