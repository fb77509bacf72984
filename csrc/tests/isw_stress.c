/*
 * isw_stress.c — concurrency stress test of the Infiniswap C core, for the sanitizers.
 *
 * `make sanitize` builds it twice from the same C files (csrc/infiniswap) as the cffi
 * module (AddressSanitizer + UndefinedBehaviorSanitizer, then ThreadSanitizer) and runs
 * both.  No Python: it drives the core through its public C API only.
 *
 * Owns: the test's bookkeeping (the version last written to each page, the store region
 * and remote of each mapped slab) and its checks; nothing of the core.
 *
 * Setup: a slab store (memfd) served by its TCP data server on 127.0.0.1, and a device
 * of NSLABS 1 MiB slabs with two remotes on that store: shared memory
 * (/proc/self/fd/<memfd>) and TCP.
 *
 * Phase 1, all at once:
 *  - IO_THREADS workers.  Worker w owns the chunks c with c % IO_THREADS == w (CHUNK_PAGES
 *    pages each, so some chunks straddle a slab boundary).  It writes page patterns that
 *    encode (page, version) and reads ranges back, checking every page against the version
 *    it last wrote there.
 *  - a controller: maps unmapped slabs onto a remote (begin_map, store alloc, map_slab) or
 *    aborts the mapping, evicts mapped slabs, unmaps a whole remote, and now and then adds
 *    a third (shm) remote, maps slabs onto it, marks it dead, evicts the failed slabs the
 *    device reports and removes it.
 *  - an observer: stats, slab_info (checking the slab invariants), sample_activity,
 *    failed_slabs, flush, the writer-delay hook, and calls that must fail cleanly.
 * Phase 2: every page checked by one thread, then again after every slab was evicted
 *   (disk only); no remote or disk error may have happened.
 * Phase 3, the fence (isw_fence.h): every slab mapped (shared memory and TCP), workers run
 *   while the "daemon" takes each slab back behind the device's back (isw_store_revoke_slab,
 *   no eviction), waits until it drained and lends it to a new owner that fills it with its
 *   own pattern.  Then one access per slab by the (stale) device must be refused and go to
 *   disk; every page must read back right and every new owner's pattern be intact.
 * Phase 4: workers race isw_device_close(): every call succeeds or fails with EBADF.
 * Phase 5: the FUSE server's buffer pool, with more threads than buffers.
 * Phase 6: a second slab store, allocated and freed by several threads at once (slots
 *   reserved under the store mutex, memory allocated without it: no slot handed out twice,
 *   the generation and fence checks of isw_store_access), an observer reading its counters,
 *   and then, with one allocation held inside the test hook (store mutex released), another
 *   thread's allocation and frees must complete.
 *
 * Usage: isw_stress [iterations per worker in phase 1, default 6000]
 * Exit status: 0 when every check passed, 1 on a data mismatch or an unexpected result
 * (each printed with the core's isw_last_error()).  A sanitizer report also makes the run
 * fail: `make sanitize` sets halt_on_error / exitcode for that.
 */
#include "isw_bufpool.h"
#include "isw_common.h"
#include "isw_dataserver.h"
#include "isw_device.h"
#include "isw_store.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdint.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define SLAB_SIZE ((uint64_t)1 << 20)
#define NSLABS 8
#define PAGE ((uint64_t)ISW_PAGE_SIZE)
#define NPAGES (NSLABS * SLAB_SIZE / PAGE)
#define PAGES_PER_SLAB (SLAB_SIZE / PAGE)
#define CHUNK_PAGES 24                  /* 256 % 24 != 0: some chunks straddle slabs */
#define NCHUNKS ((NPAGES + CHUNK_PAGES - 1) / CHUNK_PAGES)
#define IO_THREADS 4
#define WRITER_THREADS 2
#define PENDING_CAP ((uint64_t)256 << 10)    /* small: producers block on the cap */
#define STORE_SLABS (NSLABS + 2)
#define TCP_CONNECTIONS 3
#define TCP_TIMEOUT_MS 20000
#define TCP_RTO_MIN_US 10000      /* the Python API's default floor */
#define NO_REGION UINT64_MAX
#define CTL_PAUSE_US 1000               /* between control steps: mappings live a while */
#define BUFPOOL_BUFS 2
#define BUFPOOL_THREADS 6
#define BUFPOOL_SIZE ((size_t)64 << 10)
#define ALLOC_THREADS 4
#define ALLOC_SLOTS 6                   /* fewer than threads x 2: allocations contend */
#define ALLOC_ROUNDS 400
#define WAIT_TRIES 20000                /* bounded waits: 20000 x 500 us = 10 s */

/* ---------- sanitizer settings (used unless *SAN_OPTIONS say otherwise) ---------- */

#if defined(__SANITIZE_THREAD__)
#define ISW_STRESS_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define ISW_STRESS_TSAN 1
#endif
#endif

#ifdef ISW_STRESS_TSAN
/* exitcode=66: any report fails the run (ThreadSanitizer's default, made explicit).  send()
 * is intercepted again (it was not while the data server sent READ replies straight from
 * store memory; replies now leave from the connection's own buffer). */
const char *__tsan_default_options(void);
const char *__tsan_default_options(void)
{
    return "exitcode=66:second_deadlock_stack=1";
}
#endif

static atomic_int g_failures;
static atomic_int g_io_done;            /* phase 1 workers finished */
static uint32_t g_version[NPAGES];      /* page p: only its owner touches it in phases 1, 3 */

static struct isw_device *g_dev;
static struct isw_store *g_store;
static char g_shm_path[64];

static void fail(const char *fmt, ...)
{
    char msg[512];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "isw_stress: FAIL: %s\n", msg);
    atomic_fetch_add(&g_failures, 1);
}

/* rc must be `want`; else report the call, rc and the core's message.  1 if it was. */
static int expect_rc(const char *call, int rc, int want)
{
    if (rc == want)
        return 1;
    fail("%s returned %d (%s), expected %d: %s", call, rc, rc < 0 ? isw_strerror(rc) : "ok",
         want, isw_last_error());
    return 0;
}

static void fatal_if(int rc, const char *call)
{
    if (rc < 0) {
        fprintf(stderr, "isw_stress: %s failed: %s (%s)\n", call, isw_strerror(rc),
                isw_last_error());
        exit(1);
    }
}

static uint64_t next_rand(uint64_t *state)       /* splitmix64 */
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void pause_us(unsigned us)
{
    isw_sleep_us(us);
}

/* ---------- page patterns ---------- */

/* Version 0: never written, reads as zeros.  Else word 0 is the page, word 1 the version
 * and the rest a stream seeded by both. */
static void fill_page(unsigned char *p, uint64_t page, uint32_t version)
{
    uint64_t seed = page << 32 | version, w;

    memset(p, 0, PAGE);
    if (version == 0)
        return;
    memcpy(p, &page, 8);
    w = version;
    memcpy(p + 8, &w, 8);
    for (size_t i = 16; i < PAGE; i += 8) {
        w = next_rand(&seed);
        memcpy(p + i, &w, 8);
    }
}

/* Check n pages read from page `first` against the versions in g_version.  0 if all match. */
static int check_pages(const unsigned char *buf, uint64_t first, uint64_t n, const char *where)
{
    unsigned char want[ISW_PAGE_SIZE];
    int bad = 0;

    for (uint64_t i = 0; i < n; i++) {
        uint64_t page = first + i;
        fill_page(want, page, g_version[page]);
        if (memcmp(buf + i * PAGE, want, PAGE) != 0) {
            uint64_t got_page, got_version;
            memcpy(&got_page, buf + i * PAGE, 8);
            memcpy(&got_version, buf + i * PAGE + 8, 8);
            fail("%s: page %" PRIu64 " (slab %" PRIu64 ") holds page %" PRIu64 " version %"
                 PRIu64 ", expected version %u", where, page, page / PAGES_PER_SLAB, got_page,
                 got_version, g_version[page]);
            bad = 1;
        }
    }
    return bad;
}

/* ---------- I/O workers ---------- */

struct worker {
    pthread_t th;
    int id;
    long iterations;            /* < 0: until the device is closed (phase 3) */
    int stopped_by_close;
    uint64_t rng;
    unsigned char *buf;         /* CHUNK_PAGES pages */
};

/* One random write or read inside one of the worker's chunks.  Returns the core's rc. */
static int worker_op(struct worker *w)
{
    uint64_t owned = (NCHUNKS - (uint64_t)w->id + IO_THREADS - 1) / IO_THREADS;
    uint64_t chunk = (uint64_t)w->id + IO_THREADS * (next_rand(&w->rng) % owned);
    uint64_t first = chunk * CHUNK_PAGES;
    uint64_t len = NPAGES - first < CHUNK_PAGES ? NPAGES - first : CHUNK_PAGES;
    uint64_t a = first + next_rand(&w->rng) % len;
    uint64_t n = 1 + next_rand(&w->rng) % (first + len - a);
    int rc;

    if (next_rand(&w->rng) & 1) {
        for (uint64_t i = 0; i < n; i++)
            fill_page(w->buf + i * PAGE, a + i, g_version[a + i] + 1);
        rc = isw_device_write(g_dev, a * PAGE, w->buf, n * PAGE);
        if (rc == 0)
            for (uint64_t i = 0; i < n; i++)
                g_version[a + i]++;
        /* A write that failed (only EBADF is allowed, in phase 3) never ran: no page
         * changed, and the device is closed for good. */
        return rc;
    }
    rc = isw_device_read(g_dev, a * PAGE, w->buf, n * PAGE);
    if (rc == 0)
        check_pages(w->buf, a, n, "concurrent read");
    return rc;
}

static void *worker_main(void *arg)
{
    struct worker *w = arg;

    for (long i = 0; w->iterations < 0 || i < w->iterations; i++) {
        int rc = worker_op(w);
        if (rc == -EBADF && w->iterations < 0) {
            w->stopped_by_close = 1;
            break;
        }
        if (!expect_rc("isw_device_write/read", rc, 0))
            break;
    }
    return NULL;
}

static void start_workers(struct worker *ws, long iterations, uint64_t seed)
{
    for (int i = 0; i < IO_THREADS; i++) {
        ws[i].id = i;
        ws[i].iterations = iterations;
        ws[i].stopped_by_close = 0;
        ws[i].rng = seed * 1000003u + (uint64_t)i;
        if (ws[i].buf == NULL && (ws[i].buf = malloc(CHUNK_PAGES * PAGE)) == NULL)
            fatal_if(-ENOMEM, "malloc");
        fatal_if(-pthread_create(&ws[i].th, NULL, worker_main, &ws[i]), "pthread_create");
    }
}

static void join_workers(struct worker *ws)
{
    for (int i = 0; i < IO_THREADS; i++)
        pthread_join(ws[i].th, NULL);
}

/* ---------- controller: mapping, eviction, remotes ---------- */

struct controller {
    pthread_t th;
    uint64_t rng;
    int shm_id, tcp_id, extra_id;       /* extra_id: -1 when there is none */
    uint64_t region[NSLABS];            /* NO_REGION when the slab is not mapped */
    int remote[NSLABS];
    long maps, evictions, remote_unmaps, dead_remotes;
};

static void ctl_init(struct controller *c, int shm_id, int tcp_id, uint64_t seed)
{
    memset(c, 0, sizeof *c);
    c->rng = seed;
    c->shm_id = shm_id;
    c->tcp_id = tcp_id;
    c->extra_id = -1;
    for (int s = 0; s < NSLABS; s++) {
        c->region[s] = NO_REGION;
        c->remote[s] = -1;
    }
}

/* The slab's store region is no longer used by the device: give it back to the store. */
static void ctl_forget(struct controller *c, uint32_t s)
{
    if (c->region[s] == NO_REGION) {
        fail("slab %u was evicted but the test never mapped it", s);
        return;
    }
    expect_rc("isw_store_free_slab", isw_store_free_slab(g_store, c->region[s]), 0);
    c->region[s] = NO_REGION;
    c->remote[s] = -1;
}

static void ctl_map(struct controller *c, uint32_t s, int remote_id)
{
    uint64_t off;

    if (!expect_rc("isw_device_begin_map", isw_device_begin_map(g_dev, s), 0))
        return;
    if (next_rand(&c->rng) % 8 == 0) {          /* the daemon said no */
        expect_rc("isw_device_abort_map", isw_device_abort_map(g_dev, s), 0);
        return;
    }
    uint64_t gen = 0;
    if (!expect_rc("isw_store_alloc_slab", isw_store_alloc_slab(g_store, 0, &off), 0) ||
        !expect_rc("isw_store_slab_generation", isw_store_slab_generation(g_store, off, &gen), 0)) {
        isw_device_abort_map(g_dev, s);
        return;
    }
    if (!expect_rc("isw_device_map_slab", isw_device_map_slab(g_dev, s, remote_id, off, gen), 0)) {
        isw_store_free_slab(g_store, off);
        isw_device_abort_map(g_dev, s);
        return;
    }
    c->region[s] = off;
    c->remote[s] = remote_id;
    c->maps++;
}

static void ctl_evict(struct controller *c, uint32_t s)
{
    if (expect_rc("isw_device_begin_evict", isw_device_begin_evict(g_dev, s), 1)) {
        ctl_forget(c, s);
        c->evictions++;
    }
}

/* Map an unmapped slab or evict a mapped one. */
static void ctl_toggle(struct controller *c)
{
    uint32_t s = (uint32_t)(next_rand(&c->rng) % NSLABS);
    int ids[3] = { c->shm_id, c->tcp_id, c->extra_id };
    int nids = c->extra_id >= 0 ? 3 : 2;

    if (c->region[s] == NO_REGION)
        ctl_map(c, s, ids[next_rand(&c->rng) % (uint64_t)nids]);
    else
        ctl_evict(c, s);
}

/* unmap_remote must evict exactly the slabs the test mapped onto that remote. */
static void ctl_unmap_remote(struct controller *c, int remote_id)
{
    int mine = 0;

    for (uint32_t s = 0; s < NSLABS; s++)
        mine += c->remote[s] == remote_id;
    if (!expect_rc("isw_device_unmap_remote", isw_device_unmap_remote(g_dev, remote_id), mine))
        return;
    for (uint32_t s = 0; s < NSLABS; s++)
        if (c->remote[s] == remote_id)
            ctl_forget(c, s);
    c->remote_unmaps++;
}

/* The failure path: the extra remote dies; its slabs are reported failed, evicted, and the
 * remote is removed. */
static void ctl_kill_extra(struct controller *c)
{
    uint32_t failed[NSLABS];
    char msg[256];
    int mine = 0, id = c->extra_id;

    for (uint32_t s = 0; s < NSLABS; s++)
        mine += c->remote[s] == id;
    expect_rc("isw_device_mark_remote_dead", isw_device_mark_remote_dead(g_dev, id), 0);
    expect_rc("isw_device_remote_dead", isw_device_remote_dead(g_dev, id), 1);
    expect_rc("isw_device_remote_error", isw_device_remote_error(g_dev, id, msg, sizeof msg), 0);
    if (strstr(msg, "marked dead") == NULL)
        fail("remote %d's last error is '%s', expected it to say it was marked dead", id, msg);
    int n = isw_device_failed_slabs(g_dev, failed, NSLABS);
    if (expect_rc("isw_device_failed_slabs", n, mine))
        for (int i = 0; i < n; i++) {
            if (c->remote[failed[i]] != id)
                fail("failed slab %u is not on the dead remote %d", failed[i], id);
            ctl_evict(c, failed[i]);
        }
    expect_rc("isw_device_remove_remote", isw_device_remove_remote(g_dev, id), 0);
    expect_rc("isw_device_remote_dead (removed)", isw_device_remote_dead(g_dev, id), -ENOENT);
    c->extra_id = -1;
    c->dead_remotes++;
}

static void ctl_step(struct controller *c)
{
    uint64_t r = next_rand(&c->rng) % 100;

    if (r < 80) {
        ctl_toggle(c);
    } else if (r < 88) {
        ctl_unmap_remote(c, r & 1 ? c->shm_id : c->tcp_id);
    } else if (r < 94) {
        if (c->extra_id < 0) {
            c->extra_id = isw_device_add_remote_shm(g_dev, g_shm_path, 0);
            if (c->extra_id < 0) {
                expect_rc("isw_device_add_remote_shm", c->extra_id, 0);
                c->extra_id = -1;
            }
        } else {
            ctl_kill_extra(c);
        }
    } else {
        pause_us(1000);
    }
}

static void *controller_main(void *arg)
{
    struct controller *c = arg;

    while (!atomic_load(&g_io_done)) {
        ctl_step(c);
        pause_us(CTL_PAUSE_US);
    }
    if (c->extra_id >= 0)
        ctl_kill_extra(c);
    return NULL;
}

/* ---------- observer: reads state, calls that must fail ---------- */

static void check_slab_info(uint32_t s)
{
    struct isw_slab_info in;

    if (!expect_rc("isw_device_slab_info", isw_device_slab_info(g_dev, s, &in), 0))
        return;
    if (in.state < ISW_SLAB_UNMAPPED || in.state > ISW_SLAB_EVICTING)
        fail("slab %u: state %d is not a slab state", s, in.state);
    if ((in.state == ISW_SLAB_UNMAPPED || in.state == ISW_SLAB_MAPPING) &&
        (in.remote_id != -1 || in.bits_set != 0))
        fail("slab %u: state %d with remote %d and %" PRIu64 " valid remote pages", s,
             in.state, in.remote_id, in.bits_set);
    if (in.state == ISW_SLAB_MAPPED && in.remote_id < 0)
        fail("slab %u: mapped without a remote", s);
    if (in.bits_set > PAGES_PER_SLAB)
        fail("slab %u: %" PRIu64 " valid pages of %" PRIu64, s, in.bits_set,
             (uint64_t)PAGES_PER_SLAB);
}

static void check_stats(void)
{
    struct isw_device_stats st;

    if (!expect_rc("isw_device_stats", isw_device_stats(g_dev, &st), 0))
        return;
    if (st.pages_read_remote != st.bytes_read_remote / PAGE ||
        st.pages_written_disk_sync != st.bytes_written_disk_sync / PAGE)
        fail("stats: page and byte counters disagree");
    if (st.remote_errors != 0 || st.disk_errors != 0)
        fail("stats: %" PRIu64 " remote errors, %" PRIu64 " disk errors (none expected)",
             st.remote_errors, st.disk_errors);
    if (st.slabs_mapped > NSLABS)
        fail("stats: %" PRIu64 " slabs mapped of %d", st.slabs_mapped, NSLABS);
}

/* Bad arguments fail with the documented errno and a message, and change nothing. */
static void check_bad_calls(void)
{
    unsigned char page[ISW_PAGE_SIZE];

    memset(page, 0, sizeof page);
    expect_rc("begin_map(out of range)", isw_device_begin_map(g_dev, NSLABS), -ERANGE);
    if (strstr(isw_last_error(), "out of range") == NULL)
        fail("begin_map(out of range) left the message '%s'", isw_last_error());
    expect_rc("read(unaligned)", isw_device_read(g_dev, 1, page, PAGE), -EINVAL);
    expect_rc("write(past the end)", isw_device_write(g_dev, NPAGES * PAGE, page, PAGE), -ERANGE);
    expect_rc("remote_dead(unknown)", isw_device_remote_dead(g_dev, 9999), -ENOENT);
    expect_rc("map_slab(unknown remote)", isw_device_map_slab(g_dev, 0, 9999, 0, 1), -ENOENT);
    expect_rc("slab_info(out of range)", isw_device_slab_info(g_dev, NSLABS, NULL), -ERANGE);
}

static void *observer_main(void *arg)
{
    uint64_t rng = *(uint64_t *)arg, activity[NSLABS];
    uint32_t failed[NSLABS];

    while (!atomic_load(&g_io_done)) {
        check_slab_info((uint32_t)(next_rand(&rng) % NSLABS));
        check_stats();
        expect_rc("isw_device_sample_activity",
                  isw_device_sample_activity(g_dev, activity, NSLABS), NSLABS);
        if (isw_device_failed_slabs(g_dev, failed, NSLABS) < 0)
            expect_rc("isw_device_failed_slabs", -1, 0);
        switch (next_rand(&rng) % 8) {
        case 0:
            expect_rc("isw_device_flush", isw_device_flush(g_dev), 0);
            break;
        case 1:
            expect_rc("isw_device_set_debug_writer_delay",
                      isw_device_set_debug_writer_delay(g_dev, next_rand(&rng) % 2 ? 50 : 0), 0);
            break;
        case 2:
            check_bad_calls();
            break;
        default:
            break;
        }
        pause_us(300);
    }
    return NULL;
}

/* ---------- phases ---------- */

/* Read every page (in runs that span slabs and chunk owners) and check it. */
static void check_all_pages(const char *where)
{
    enum { RUN = 40 };
    unsigned char *buf = malloc(RUN * PAGE);

    if (buf == NULL)
        fatal_if(-ENOMEM, "malloc");
    for (uint64_t p = 0; p < NPAGES; p += RUN) {
        uint64_t n = NPAGES - p < RUN ? NPAGES - p : RUN;
        if (expect_rc("isw_device_read", isw_device_read(g_dev, p * PAGE, buf, n * PAGE), 0))
            check_pages(buf, p, n, where);
    }
    free(buf);
}

static void phase_concurrent(struct controller *c, struct worker *ws, long iterations)
{
    pthread_t obs;
    uint64_t obs_seed = 77;

    start_workers(ws, iterations, 1);
    fatal_if(-pthread_create(&c->th, NULL, controller_main, c), "pthread_create");
    fatal_if(-pthread_create(&obs, NULL, observer_main, &obs_seed), "pthread_create");
    join_workers(ws);
    atomic_store(&g_io_done, 1);
    pthread_join(c->th, NULL);
    pthread_join(obs, NULL);
}

static void phase_verify(struct controller *c)
{
    struct isw_device_stats st;

    check_all_pages("final read (slabs mapped)");
    for (uint32_t s = 0; s < NSLABS; s++)
        if (c->region[s] != NO_REGION)
            ctl_evict(c, s);
    check_all_pages("final read (every slab unmapped)");
    check_stats();
    expect_rc("isw_device_stats", isw_device_stats(g_dev, &st), 0);
    printf("isw_stress: %ld maps, %ld evictions, %ld remote unmaps, %ld dead remotes; "
           "%" PRIu64 " MiB written to / %" PRIu64 " MiB read from remote memory\n",
           c->maps, c->evictions, c->remote_unmaps, c->dead_remotes,
           st.bytes_written_remote >> 20, st.bytes_read_remote >> 20);
    if (c->maps == 0 || st.bytes_written_remote == 0 || st.bytes_read_remote == 0)
        fail("the remote path was not exercised (no map or no remote I/O)");
}

/* ---------- phase 3: the fence ---------- */

/* The pattern a slab's new owner writes: pages numbered past the device's. */
static void fill_owner_page(unsigned char *p, uint32_t s, uint64_t i)
{
    fill_page(p, NPAGES + (uint64_t)s * PAGES_PER_SLAB + i, 0xF00D);
}

static void owner_fill(uint32_t s, uint64_t region)
{
    unsigned char page[ISW_PAGE_SIZE];

    for (uint64_t i = 0; i < PAGES_PER_SLAB; i++) {
        fill_owner_page(page, s, i);
        expect_rc("isw_store_write (new owner)",
                  isw_store_write(g_store, region + i * PAGE, page, PAGE), 0);
    }
}

static void owner_check(uint32_t s, uint64_t region)
{
    unsigned char want[ISW_PAGE_SIZE], got[ISW_PAGE_SIZE];

    for (uint64_t i = 0; i < PAGES_PER_SLAB; i++) {
        fill_owner_page(want, s, i);
        if (expect_rc("isw_store_read (new owner)",
                      isw_store_read(g_store, region + i * PAGE, got, PAGE), 0) &&
            memcmp(want, got, PAGE) != 0) {
            fail("fence: page %" PRIu64 " of slab %u's new owner was overwritten by the "
                 "device it was taken from", i, s);
            return;
        }
    }
}

/* Take slab s back from the device without telling it, wait for its accesses to drain. */
static void revoke_behind_its_back(struct controller *c, uint32_t s)
{
    uint64_t region = c->region[s];
    int rc = isw_store_revoke_slab(g_store, region);

    if (rc < 0) {
        expect_rc("isw_store_revoke_slab", rc, 1);
        return;
    }
    for (int t = 0; t < WAIT_TRIES && isw_store_slab_drained(g_store, region) != 1; t++)
        pause_us(500);
    if (!expect_rc("isw_store_slab_drained", isw_store_slab_drained(g_store, region), 1))
        return;
    owner_fill(s, region);
}

static void phase_fence(struct controller *c, struct worker *ws, long iterations)
{
    unsigned char page[ISW_PAGE_SIZE];
    struct isw_slab_info in;
    struct isw_device_stats st;

    for (uint32_t s = 0; s < NSLABS; s++)
        if (c->region[s] == NO_REGION)
            ctl_map(c, s, s % 2 ? c->tcp_id : c->shm_id);
    for (uint32_t s = 0; s < NSLABS; s++)       /* ctl_map may abort ("the daemon said no") */
        while (c->region[s] == NO_REGION)
            ctl_map(c, s, s % 2 ? c->tcp_id : c->shm_id);
    start_workers(ws, iterations, 3);
    for (uint32_t s = 0; s < NSLABS; s++) {
        pause_us(CTL_PAUSE_US);
        revoke_behind_its_back(c, s);
    }
    join_workers(ws);
    /* The stale device touches every slab once more: refused, to disk. */
    for (uint32_t s = 0; s < NSLABS; s++) {
        uint64_t p = (uint64_t)s * PAGES_PER_SLAB + 5;
        fill_page(page, p, g_version[p] + 1);
        if (expect_rc("isw_device_write (stale mapping)",
                      isw_device_write(g_dev, p * PAGE, page, PAGE), 0))
            g_version[p]++;
        /* Page bits may still be set by a remote write that finished before the revoke and
         * set them after the refusal cleared them; EVICTING ignores them, eviction clears
         * them (checked below). */
        if (expect_rc("isw_device_slab_info", isw_device_slab_info(g_dev, s, &in), 0) &&
            (in.state != ISW_SLAB_EVICTING || !in.failed))
            fail("fence: slab %u is in state %d (failed %d) after an access with a revoked "
                 "generation", s, in.state, in.failed);
    }
    check_all_pages("read after the fence");
    for (uint32_t s = 0; s < NSLABS; s++)
        owner_check(s, c->region[s]);
    expect_rc("isw_device_stats", isw_device_stats(g_dev, &st), 0);
    if (st.remote_errors < NSLABS || st.disk_errors != 0)
        fail("fence: %" PRIu64 " refused accesses (expected >= %d), %" PRIu64 " disk errors",
             st.remote_errors, NSLABS, st.disk_errors);
    for (uint32_t s = 0; s < NSLABS; s++) {     /* the late EVICT; the owner gives it back */
        ctl_evict(c, s);
        check_slab_info(s);                     /* unmapped: no remote page left */
    }
    check_all_pages("read after the fence (every slab unmapped)");
    printf("isw_stress: fence: %" PRIu64 " accesses refused\n", st.remote_errors);
}

static void phase_close_race(struct controller *c, struct worker *ws)
{
    for (uint32_t s = 0; s < NSLABS; s += 2)
        ctl_map(c, s, s % 4 == 0 ? c->shm_id : c->tcp_id);
    start_workers(ws, -1, 2);
    pause_us(20000);
    expect_rc("isw_device_close", isw_device_close(g_dev), 0);
    join_workers(ws);
    for (int i = 0; i < IO_THREADS; i++)
        if (!ws[i].stopped_by_close)
            fail("worker %d did not end with EBADF after close", i);
    expect_rc("isw_device_close (again)", isw_device_close(g_dev), 0);
    expect_rc("isw_device_flush (closed)", isw_device_flush(g_dev), -EBADF);
    expect_rc("isw_device_begin_map (closed)", isw_device_begin_map(g_dev, 0), -EBADF);
    expect_rc("isw_device_remote_dead (closed)", isw_device_remote_dead(g_dev, 0), -EBADF);
    isw_device_free(g_dev);
    g_dev = NULL;
    for (uint32_t s = 0; s < NSLABS; s++)
        if (c->region[s] != NO_REGION)
            ctl_forget(c, s);
}

static atomic_uint g_bufpool_tag;

static void *bufpool_user(void *arg)
{
    struct isw_bufpool *pool = arg;
    unsigned char *b = isw_bufpool_thread_buffer(pool);
    unsigned char tag = (unsigned char)(1 + atomic_fetch_add(&g_bufpool_tag, 1));

    if (b == NULL) {
        fail("isw_bufpool_thread_buffer returned NULL");
        return NULL;
    }
    if (isw_bufpool_thread_buffer(pool) != b)
        fail("a thread got two different buffers");
    memset(b, tag, BUFPOOL_SIZE);
    pause_us(2000);
    for (size_t i = 0; i < BUFPOOL_SIZE; i++)
        if (b[i] != tag) {
            fail("buffer pool: another thread wrote this thread's buffer");
            break;
        }
    return NULL;
}

static void phase_bufpool(void)
{
    struct isw_bufpool *pool;
    pthread_t th[BUFPOOL_THREADS];

    fatal_if(isw_bufpool_create(BUFPOOL_BUFS, BUFPOOL_SIZE, &pool), "isw_bufpool_create");
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < BUFPOOL_THREADS; i++)
            fatal_if(-pthread_create(&th[i], NULL, bufpool_user, pool), "pthread_create");
        for (int i = 0; i < BUFPOOL_THREADS; i++)
            pthread_join(th[i], NULL);
    }
    isw_bufpool_destroy(pool);
}

/* ---------- phase 6: a store allocated from several threads ---------- */

static struct isw_store *g_astore;
static atomic_int g_owner[ALLOC_SLOTS];     /* allocator id + 1 holding the slot, 0 if none */
static atomic_int g_alloc_done;

/* One allocation's checks: its own slot, its data, its generation and fence. */
static void allocator_use(int id, uint64_t off)
{
    unsigned char mine[ISW_PAGE_SIZE], back[ISW_PAGE_SIZE];
    int slot = (int)(off / SLAB_SIZE), expected = 0;
    uint64_t gen = 0;

    if (!atomic_compare_exchange_strong(&g_owner[slot], &expected, id + 1)) {
        fail("store slot %d was handed to allocator %d while %d held it", slot, id, expected - 1);
        return;
    }
    memset(mine, id + 1, PAGE);
    expect_rc("isw_store_slab_generation", isw_store_slab_generation(g_astore, off, &gen), 0);
    expect_rc("isw_store_access (write)", isw_store_access(g_astore, off, PAGE, gen, mine, 1), 0);
    if (expect_rc("isw_store_access (read)", isw_store_access(g_astore, off, PAGE, gen, back, 0), 0)
        && memcmp(mine, back, PAGE) != 0)
        fail("allocator %d read another allocator's data in its slab", id);
    expect_rc("isw_store_access (old generation)",
              isw_store_access(g_astore, off, PAGE, gen - 1, back, 0), -ESTALE);
    expect_rc("isw_store_revoke_slab", isw_store_revoke_slab(g_astore, off), 1);
    expect_rc("isw_store_access (revoked)", isw_store_access(g_astore, off, PAGE, gen, back, 0),
              -ESTALE);
    atomic_store(&g_owner[slot], 0);
}

static void *allocator_main(void *arg)
{
    int id = (int)(intptr_t)arg;

    for (int r = 0; r < ALLOC_ROUNDS; r++) {
        uint64_t off;
        int lock = id == 0 && r % 4 == 0;
        int rc = isw_store_alloc_slab(g_astore, lock, &off);
        if (rc == -ENOSPC || (lock && (rc == -ENOMEM || rc == -EPERM || rc == -EAGAIN))) {
            pause_us(20);                   /* all taken, or RLIMIT_MEMLOCK: fine */
            continue;
        }
        if (!expect_rc("isw_store_alloc_slab", rc, 0))
            break;
        allocator_use(id, off);
        expect_rc("isw_store_free_slab", isw_store_free_slab(g_astore, off), 0);
    }
    return NULL;
}

static void *store_observer_main(void *arg)
{
    (void)arg;
    while (!atomic_load(&g_alloc_done)) {
        uint64_t resident;
        if (isw_store_allocated_bytes(g_astore) > ALLOC_SLOTS * SLAB_SIZE ||
            isw_store_locked_bytes(g_astore) > isw_store_allocated_bytes(g_astore) + SLAB_SIZE)
            fail("store counters out of range while allocating");
        expect_rc("isw_store_resident_bytes", isw_store_resident_bytes(g_astore, &resident), 0);
        pause_us(100);
    }
    return NULL;
}

struct held_alloc {
    uint64_t off;
    int rc;
    atomic_int done;
};

static void *held_alloc_main(void *arg)
{
    struct held_alloc *h = arg;
    h->rc = isw_store_alloc_slab(g_astore, 0, &h->off);
    atomic_store(&h->done, 1);
    return NULL;
}

/* Wait (bounded) until *flag == want; 1 if it did. */
static int wait_flag(atomic_int *flag, int want)
{
    for (int t = 0; t < WAIT_TRIES && atomic_load(flag) != want; t++)
        pause_us(500);
    return atomic_load(flag) == want;
}

/* One allocation held inside the test hook; the store must go on serving other calls. */
static void store_hold_check(void)
{
    struct held_alloc held = { 0 }, other = { 0 };
    pthread_t th_held, th_other;

    expect_rc("isw_store_debug_hold_allocations", isw_store_debug_hold_allocations(g_astore, 1), 0);
    fatal_if(-pthread_create(&th_held, NULL, held_alloc_main, &held), "pthread_create");
    for (int t = 0; t < WAIT_TRIES && isw_store_debug_allocations_held(g_astore) != 1; t++)
        pause_us(500);
    if (!expect_rc("isw_store_debug_allocations_held", isw_store_debug_allocations_held(g_astore), 1))
        exit(1);
    fatal_if(-pthread_create(&th_other, NULL, held_alloc_main, &other), "pthread_create");
    if (!wait_flag(&other.done, 1)) {
        fail("an allocation waited for another allocation in progress (store mutex held?)");
        exit(1);
    }
    pthread_join(th_other, NULL);
    expect_rc("isw_store_alloc_slab (beside a held one)", other.rc, 0);
    if (isw_store_allocated_bytes(g_astore) != SLAB_SIZE)
        fail("the held allocation was published before it finished");
    expect_rc("isw_store_free_slab (beside a held one)", isw_store_free_slab(g_astore, other.off), 0);
    if (atomic_load(&held.done))
        fail("the held allocation did not wait in the test hook");
    expect_rc("isw_store_debug_hold_allocations", isw_store_debug_hold_allocations(g_astore, 0), 0);
    pthread_join(th_held, NULL);
    if (expect_rc("isw_store_alloc_slab (held)", held.rc, 0))
        expect_rc("isw_store_free_slab (held)", isw_store_free_slab(g_astore, held.off), 0);
}

static void phase_store_allocations(void)
{
    pthread_t th[ALLOC_THREADS], obs;

    fatal_if(isw_store_open(ALLOC_SLOTS * SLAB_SIZE, SLAB_SIZE, &g_astore), "isw_store_open");
    for (int i = 0; i < ALLOC_THREADS; i++)
        fatal_if(-pthread_create(&th[i], NULL, allocator_main, (void *)(intptr_t)i),
                 "pthread_create");
    fatal_if(-pthread_create(&obs, NULL, store_observer_main, NULL), "pthread_create");
    for (int i = 0; i < ALLOC_THREADS; i++)
        pthread_join(th[i], NULL);
    atomic_store(&g_alloc_done, 1);
    pthread_join(obs, NULL);
    if (isw_store_allocated_bytes(g_astore) != 0 || isw_store_locked_bytes(g_astore) != 0)
        fail("store: slabs left allocated after every allocator freed its own");
    store_hold_check();
    isw_store_free(g_astore);
}

int main(int argc, char **argv)
{
    long iterations = argc > 1 ? strtol(argv[1], NULL, 10) : 6000;
    char dir[] = "/tmp/isw-stress-XXXXXX", backup[64];
    struct isw_server *srv;
    struct controller ctl;
    struct worker ws[IO_THREADS];

    if (iterations < 1) {
        fprintf(stderr, "usage: %s [iterations per worker >= 1]\n", argv[0]);
        return 2;
    }
    setvbuf(stdout, NULL, _IONBF, 0);
    if (mkdtemp(dir) == NULL)
        fatal_if(-errno, "mkdtemp");
    snprintf(backup, sizeof backup, "%s/backup", dir);
    fatal_if(isw_store_open(STORE_SLABS * SLAB_SIZE, SLAB_SIZE, &g_store), "isw_store_open");
    snprintf(g_shm_path, sizeof g_shm_path, "/proc/self/fd/%d", isw_store_fd(g_store));
    static const unsigned char key[32] = "isw_stress cluster key, 32 bytes";
    fatal_if(isw_server_start(g_store, "127.0.0.1", 0, key, sizeof key, 0, TCP_RTO_MIN_US, 0, &srv),
             "isw_server_start");
    fatal_if(isw_device_open(NSLABS * SLAB_SIZE, SLAB_SIZE, backup, WRITER_THREADS, PENDING_CAP,
                             &g_dev), "isw_device_open");
    int shm_id = isw_device_add_remote_shm(g_dev, g_shm_path, 0);
    fatal_if(shm_id, "isw_device_add_remote_shm");
    int tcp_id = isw_device_add_remote_tcp(g_dev, "127.0.0.1", isw_server_port(srv),
                                           TCP_CONNECTIONS, TCP_TIMEOUT_MS, TCP_RTO_MIN_US, key,
                                           sizeof key);
    fatal_if(tcp_id, "isw_device_add_remote_tcp");
    memset(ws, 0, sizeof ws);
    ctl_init(&ctl, shm_id, tcp_id, 42);

    printf("isw_stress: phase 1: %d workers x %ld I/Os, controller, observer\n", IO_THREADS,
           iterations);
    phase_concurrent(&ctl, ws, iterations);
    printf("isw_stress: phase 2: verify every page\n");
    phase_verify(&ctl);
    printf("isw_stress: phase 3: the fence\n");
    phase_fence(&ctl, ws, iterations / 4 + 1);
    printf("isw_stress: phase 4: I/O racing close\n");
    phase_close_race(&ctl, ws);
    printf("isw_stress: phase 5: buffer pool\n");
    phase_bufpool();
    printf("isw_stress: phase 6: concurrent slab allocation\n");
    phase_store_allocations();

    struct isw_server_stats ss;
    isw_server_get_stats(srv, &ss);
    /* Its only errors: the fence refusing the stale device (at least once per TCP slab). */
    if (ss.requests == 0 || ss.errors < NSLABS / 2)
        fail("data server: %" PRIu64 " requests, %" PRIu64 " errors (the fence refuses at "
             "least %d)", ss.requests, ss.errors, NSLABS / 2);
    isw_server_free(srv);
    isw_store_free(g_store);
    for (int i = 0; i < IO_THREADS; i++)
        free(ws[i].buf);
    unlink(backup);
    rmdir(dir);

    int failures = atomic_load(&g_failures);
    if (failures != 0) {
        fprintf(stderr, "isw_stress: %d check(s) failed\n", failures);
        return 1;
    }
    printf("isw_stress: all checks passed\n");
    return 0;
}
