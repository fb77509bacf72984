/*
 * isw_rdma.c — a verbs device, its registration table, RC queue pairs, and the RDMA remote.
 *
 * Owns: the device context and protection domain (struct isw_rdma), the table of memory
 * regions registered through it (by address range, reference counted), the queue pairs
 * it makes, and the remote backend "rdma" (READ/WRITE of a daemon's slab through a
 * registered bounce buffer, one operation at a time per remote).
 *
 * The table is kept the same way with or without hardware: a region is found by the
 * range it holds, so registering a range inside one already registered reuses it.  The
 * "fake" device (isw_rdma_debug_open_fake) hands out keys from a counter instead of
 * calling ibv_reg_mr; everything else of the table is the same code.  Its queue pairs live
 * on the fake fabric (one table per process, below): a transfer is a memcpy checked
 * against both devices' tables as a NIC checks it, so the remote above them is the same
 * code on the fake fabric and on hardware.
 *
 * Built with ISW_HAVE_VERBS (libibverbs) the device parts are real; without it the
 * functions that need a device fail with -ENOTSUP and a message saying what to install.
 * Not run on hardware (see isw_rdma.h).
 */
#include "isw_rdma.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef ISW_HAVE_VERBS
#include <infiniband/verbs.h>
#include <sys/random.h>
#endif

#define NO_DEVICE "no RDMA device found (ibv_get_device_list returned none): use --transport tcp"
#define NOT_BUILT "this Infiniswap core was built without libibverbs: install libibverbs-dev and " \
                  "run `make setup` again, or use --transport tcp"
#define QP_DEPTH 16
#define FAKE_MTU 5                           /* IBV_MTU_4096 */
#define BOUNCE_SIZE ((size_t)1 << 20)
#define OP_TIMEOUT_NS 10000000000LL          /* 10 s: a completion later than that is a failure */

struct region {
    uintptr_t addr;
    uint64_t len;
    int writable;
    int refs;
    uint32_t lkey, rkey;
    void *mr;                                /* struct ibv_mr *, NULL on the fake device */
};

struct isw_rdma {
    pthread_mutex_t mu;                      /* the table */
    struct region *regions;                  /* unsorted; few (one per lent slab) */
    size_t nregions, cap;
    int fake;
    uint16_t fake_lid;                       /* the fake device's port LID */
    atomic_int refs;                         /* 1 until closed, + 1 per queue pair */
    char name[64];
#ifdef ISW_HAVE_VERBS
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    int port, gid_index;
    struct ibv_port_attr port_attr;
    union ibv_gid gid;
    int global;
    int rd_atomic;
#endif
};

/* ---- the registration table ---- */

static struct region *find_region(struct isw_rdma *r, uintptr_t addr, uint64_t len, int writable)
{
    for (size_t i = 0; i < r->nregions; i++) {
        struct region *g = &r->regions[i];
        if (g->addr <= addr && addr - g->addr <= g->len && len <= g->len - (addr - g->addr)
            && (g->writable || !writable))
            return g;
    }
    return NULL;
}

/* The fake devices' keys: one counter for the process, so a key of one fake device never
 * opens a region of another, and a deregistered region's key is never handed out again. */
static atomic_uint fake_keys = 0x100;

static int register_mr(struct isw_rdma *r, struct region *g)
{
    if (r->fake) {
        g->lkey = g->rkey = atomic_fetch_add(&fake_keys, 1);
        g->mr = NULL;
        return 0;
    }
#ifdef ISW_HAVE_VERBS
    int access = IBV_ACCESS_REMOTE_READ;
    if (g->writable)
        access |= IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    struct ibv_mr *mr = ibv_reg_mr(r->pd, (void *)g->addr, g->len, access);
    if (mr == NULL) {
        int err = errno ? errno : EIO;
        return isw_fail(err, "cannot register %llu bytes with %s: %s (is `ulimit -l` large enough?)",
                        (unsigned long long)g->len, r->name, isw_strerror(-err));
    }
    g->lkey = mr->lkey;
    g->rkey = mr->rkey;
    g->mr = mr;
    return 0;
#else
    return isw_fail(ENOTSUP, NOT_BUILT);
#endif
}

static void deregister_mr(struct region *g)
{
#ifdef ISW_HAVE_VERBS
    if (g->mr != NULL)
        ibv_dereg_mr(g->mr);
#endif
    g->mr = NULL;
}

int isw_rdma_reg(struct isw_rdma *r, void *addr, uint64_t len, int writable, uint32_t *lkey,
                 uint32_t *rkey)
{
    if (r == NULL || addr == NULL || len == 0)
        return isw_fail(EINVAL, "isw_rdma_reg: a device, an address and a length are needed");
    pthread_mutex_lock(&r->mu);
    struct region *g = find_region(r, (uintptr_t)addr, len, writable);
    if (g == NULL) {
        if (r->nregions == r->cap) {
            size_t cap = r->cap ? 2 * r->cap : 16;
            struct region *grown = realloc(r->regions, cap * sizeof *grown);
            if (grown == NULL) {
                pthread_mutex_unlock(&r->mu);
                return isw_fail(ENOMEM, "out of memory");
            }
            r->regions = grown;
            r->cap = cap;
        }
        struct region fresh = { .addr = (uintptr_t)addr, .len = len, .writable = !!writable };
        int rc = register_mr(r, &fresh);
        if (rc < 0) {
            pthread_mutex_unlock(&r->mu);
            return rc;
        }
        g = &r->regions[r->nregions++];
        *g = fresh;
    }
    g->refs++;
    *lkey = g->lkey;
    *rkey = g->rkey;
    pthread_mutex_unlock(&r->mu);
    return 0;
}

int isw_rdma_lookup(struct isw_rdma *r, const void *addr, uint64_t len, int writable,
                    uint32_t *lkey, uint32_t *rkey)
{
    pthread_mutex_lock(&r->mu);
    struct region *g = find_region(r, (uintptr_t)addr, len, writable);
    if (g != NULL) {
        *lkey = g->lkey;
        *rkey = g->rkey;
    }
    pthread_mutex_unlock(&r->mu);
    return g != NULL ? 0 : -ENOENT;
}

int isw_rdma_dereg(struct isw_rdma *r, const void *addr, uint64_t len)
{
    struct region *g = NULL;

    pthread_mutex_lock(&r->mu);
    for (size_t i = 0; i < r->nregions && g == NULL; i++)     /* the range registered, first */
        if (r->regions[i].addr == (uintptr_t)addr && r->regions[i].len == len)
            g = &r->regions[i];
    if (g == NULL)
        g = find_region(r, (uintptr_t)addr, len, 0);
    if (g == NULL) {
        pthread_mutex_unlock(&r->mu);
        return isw_fail(ENOENT, "no registered region holds [%p, +%llu)", addr, (unsigned long long)len);
    }
    if (--g->refs == 0) {
        deregister_mr(g);
        *g = r->regions[--r->nregions];
    }
    pthread_mutex_unlock(&r->mu);
    return 0;
}

int isw_rdma_region_count(struct isw_rdma *r)
{
    pthread_mutex_lock(&r->mu);
    int n = (int)r->nregions;
    pthread_mutex_unlock(&r->mu);
    return n;
}

/* ---- the device ---- */

static struct isw_rdma *rdma_alloc(const char *name, int fake)
{
    struct isw_rdma *r = calloc(1, sizeof *r);
    if (r == NULL)
        return NULL;
    pthread_mutex_init(&r->mu, NULL);
    r->fake = fake;
    atomic_init(&r->refs, 1);
    snprintf(r->name, sizeof r->name, "%s", name);
    return r;
}

static atomic_uint fake_lids = 1;

int isw_rdma_debug_open_fake(struct isw_rdma **out)
{
    *out = rdma_alloc("fake", 1);
    if (*out == NULL)
        return isw_fail(ENOMEM, "out of memory");
    (*out)->fake_lid = (uint16_t)atomic_fetch_add(&fake_lids, 1);
    return 0;
}

const char *isw_rdma_device_name(struct isw_rdma *r)
{
    return r->name;
}

/* Drop one reference: the last one (close, and every queue pair destroyed) frees the device. */
static void rdma_put(struct isw_rdma *r)
{
    if (atomic_fetch_sub(&r->refs, 1) != 1)
        return;
    for (size_t i = 0; i < r->nregions; i++)
        deregister_mr(&r->regions[i]);
    free(r->regions);
#ifdef ISW_HAVE_VERBS
    if (r->pd != NULL)
        ibv_dealloc_pd(r->pd);
    if (r->ctx != NULL)
        ibv_close_device(r->ctx);
#endif
    pthread_mutex_destroy(&r->mu);
    free(r);
}

void isw_rdma_close(struct isw_rdma *r)
{
    if (r != NULL)
        rdma_put(r);
}

/* ---- queue pairs ---- */

struct isw_rdma_qp {
    struct isw_rdma *r;                      /* holds a reference */
    uint32_t qpn, psn;
    /* the fake fabric's, under fabric_mu */
    struct isw_rdma_qp *next;
    uint32_t peer_qpn;                       /* 0: not connected */
    int broken;                              /* an operation failed: the error state */
#ifdef ISW_HAVE_VERBS
    struct ibv_cq *cq;
    struct ibv_qp *qp;
#endif
};

/* ---- the fake fabric: every fake queue pair of this process ---- */

static pthread_mutex_t fabric_mu = PTHREAD_MUTEX_INITIALIZER;
static struct isw_rdma_qp *fabric;
static uint32_t fabric_next_qpn = 0x11;

static int fake_qp_create(struct isw_rdma *r, struct isw_rdma_qp **out, struct isw_rdma_qp_info *local)
{
    struct isw_rdma_qp *q = calloc(1, sizeof *q);
    if (q == NULL)
        return isw_fail(ENOMEM, "out of memory");
    q->r = r;
    pthread_mutex_lock(&fabric_mu);
    q->qpn = fabric_next_qpn;
    fabric_next_qpn = (fabric_next_qpn + 1) & 0xFFFFFF;
    if (fabric_next_qpn == 0)
        fabric_next_qpn = 1;
    q->psn = (q->qpn * 2654435761u) & 0xFFFFFF;
    q->next = fabric;
    fabric = q;
    pthread_mutex_unlock(&fabric_mu);
    memset(local, 0, sizeof *local);
    local->qpn = q->qpn;
    local->psn = q->psn;
    local->lid = r->fake_lid;
    local->mtu = FAKE_MTU;
    *out = q;
    return 0;
}

static int fake_qp_connect(struct isw_rdma_qp *q, const struct isw_rdma_qp_info *remote)
{
    if (remote->qpn == 0 || remote->qpn > 0xFFFFFF || remote->psn > 0xFFFFFF)
        return isw_fail(EINVAL, "queue pair %u of %s: INIT -> RTR towards %u refused", q->qpn,
                        q->r->name, remote->qpn);
    pthread_mutex_lock(&fabric_mu);
    q->peer_qpn = remote->qpn;
    q->broken = 0;
    pthread_mutex_unlock(&fabric_mu);
    return 0;
}

static void fake_qp_destroy(struct isw_rdma_qp *q)
{
    pthread_mutex_lock(&fabric_mu);
    for (struct isw_rdma_qp **p = &fabric; *p != NULL; p = &(*p)->next)
        if (*p == q) {
            *p = q->next;
            break;
        }
    pthread_mutex_unlock(&fabric_mu);
}

/* Under the region table's mutex: the region with key `key` (an rkey if `remote`, else an
 * lkey) holding [addr, addr + len), writable if asked; NULL if none. */
static struct region *find_keyed(struct isw_rdma *r, uintptr_t addr, uint64_t len, uint32_t key,
                                 int remote, int writable)
{
    for (size_t i = 0; i < r->nregions; i++) {
        struct region *g = &r->regions[i];
        if ((remote ? g->rkey : g->lkey) == key && g->addr <= addr && addr - g->addr <= g->len
            && len <= g->len - (addr - g->addr) && (g->writable || !writable))
            return g;
    }
    return NULL;
}

/* A READ or WRITE on the fake fabric, checked as a NIC checks it: 0, or -EIO with the
 * completion status a NIC would give (the queue pair is in the error state from then on).
 * The copy runs under the peer device's table mutex, so once isw_rdma_dereg of a region
 * returns no copy touches it any more (on hardware: once ibv_dereg_mr returns). */
static int fake_transfer(struct isw_rdma_qp *q, int write, void *local, uint32_t lkey, uint32_t len,
                         uint64_t remote_addr, uint32_t rkey)
{
    const char *what = write ? "WRITE" : "READ";
    struct isw_rdma_qp *peer = NULL;
    int rc = 0;

    pthread_mutex_lock(&fabric_mu);
    for (struct isw_rdma_qp *p = fabric; p != NULL && peer == NULL; p = p->next)
        if (p->qpn == q->peer_qpn && q->peer_qpn != 0)
            peer = p;
    if (q->broken) {
        rc = isw_fail(EIO, "RDMA %s failed: Work Request Flushed Error (the queue pair is in the "
                      "error state)", what);
    } else if (peer == NULL || peer->peer_qpn != q->qpn) {
        rc = isw_fail(EIO, "RDMA %s failed: transport retry counter exceeded (no queue pair %u "
                      "connected to queue pair %u)", what, q->peer_qpn, q->qpn);
    } else {
        pthread_mutex_lock(&q->r->mu);
        if (find_keyed(q->r, (uintptr_t)local, len, lkey, 0, !write) == NULL)
            rc = isw_fail(EIO, "RDMA %s failed: local protection error (lkey %#x does not hold "
                          "[%p, +%u))", what, lkey, local, len);
        pthread_mutex_unlock(&q->r->mu);
    }
    if (rc == 0) {
        struct isw_rdma *far = peer->r;
        pthread_mutex_lock(&far->mu);
        if (find_keyed(far, (uintptr_t)remote_addr, len, rkey, 1, write) == NULL)
            rc = isw_fail(EIO, "RDMA %s failed: remote access error (rkey %#x does not grant "
                          "[%#llx, +%u))", what, rkey, (unsigned long long)remote_addr, len);
        else if (write)
            memcpy((void *)(uintptr_t)remote_addr, local, len);
        else
            memcpy(local, (const void *)(uintptr_t)remote_addr, len);
        pthread_mutex_unlock(&far->mu);
    }
    if (rc < 0)
        q->broken = 1;
    pthread_mutex_unlock(&fabric_mu);
    return rc;
}

#ifdef ISW_HAVE_VERBS

int isw_rdma_built(void)
{
    return 1;
}

int isw_rdma_device_count(void)
{
    int n = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    if (list == NULL)
        return 0;
    ibv_free_device_list(list);
    return n;
}

/* Open `dev` into r: context, PD, port attributes, GID, limits.  0 or -errno (recorded). */
static int open_device(struct isw_rdma *r, struct ibv_device *dev, int port, int gid_index)
{
    struct ibv_device_attr attr;

    r->ctx = ibv_open_device(dev);
    if (r->ctx == NULL)
        return isw_fail(errno ? errno : EIO, "cannot open RDMA device %s", r->name);
    r->pd = ibv_alloc_pd(r->ctx);
    if (r->pd == NULL)
        return isw_fail(errno ? errno : EIO, "cannot allocate a protection domain on %s", r->name);
    r->port = port;
    r->gid_index = gid_index;
    if (ibv_query_port(r->ctx, (uint8_t)port, &r->port_attr) != 0)
        return isw_fail(EINVAL, "%s has no port %d", r->name, port);
    if (r->port_attr.state != IBV_PORT_ACTIVE)
        return isw_fail(ENETDOWN, "port %d of %s is not active", port, r->name);
    r->global = r->port_attr.link_layer == IBV_LINK_LAYER_ETHERNET;
    if (r->port_attr.gid_tbl_len > 0 && ibv_query_gid(r->ctx, (uint8_t)port, gid_index, &r->gid) != 0)
        return isw_fail(EINVAL, "%s port %d has no GID at index %d", r->name, port, gid_index);
    if (ibv_query_device(r->ctx, &attr) != 0)
        return isw_fail(EIO, "cannot query %s", r->name);
    r->rd_atomic = attr.max_qp_rd_atom < attr.max_qp_init_rd_atom ? attr.max_qp_rd_atom
                                                                   : attr.max_qp_init_rd_atom;
    if (r->rd_atomic > QP_DEPTH)
        r->rd_atomic = QP_DEPTH;
    if (r->rd_atomic < 1)
        r->rd_atomic = 1;
    return 0;
}

int isw_rdma_open(const char *name, int port, int gid_index, struct isw_rdma **out)
{
    int n = 0, rc;
    struct ibv_device **list = ibv_get_device_list(&n);
    struct ibv_device *dev = NULL;

    *out = NULL;
    if (list == NULL || n == 0) {
        if (list != NULL)
            ibv_free_device_list(list);
        return isw_fail(ENODEV, NO_DEVICE);
    }
    for (int i = 0; i < n && dev == NULL; i++)
        if (name == NULL || name[0] == '\0' || strcmp(ibv_get_device_name(list[i]), name) == 0)
            dev = list[i];
    if (dev == NULL) {
        ibv_free_device_list(list);
        return isw_fail(ENODEV, "RDMA device '%s' not found (%d other device(s)): use --transport tcp",
                        name, n);
    }
    struct isw_rdma *r = rdma_alloc(ibv_get_device_name(dev), 0);
    if (r == NULL) {
        ibv_free_device_list(list);
        return isw_fail(ENOMEM, "out of memory");
    }
    rc = open_device(r, dev, port > 0 ? port : 1, gid_index);
    ibv_free_device_list(list);
    if (rc < 0) {
        isw_rdma_close(r);
        return rc;
    }
    *out = r;
    return 0;
}

static int verbs_qp_create(struct isw_rdma *r, struct isw_rdma_qp **out, struct isw_rdma_qp_info *local)
{
    struct isw_rdma_qp *q = calloc(1, sizeof *q);
    if (q == NULL)
        return isw_fail(ENOMEM, "out of memory");
    q->r = r;
    q->cq = ibv_create_cq(r->ctx, 2 * QP_DEPTH, NULL, NULL, 0);
    if (q->cq == NULL) {
        free(q);
        return isw_fail(errno ? errno : EIO, "cannot create a completion queue on %s", r->name);
    }
    struct ibv_qp_init_attr init = {
        .send_cq = q->cq, .recv_cq = q->cq, .qp_type = IBV_QPT_RC, .sq_sig_all = 1,
        .cap = { .max_send_wr = QP_DEPTH, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1 },
    };
    q->qp = ibv_create_qp(r->pd, &init);
    if (q->qp == NULL) {
        int err = errno ? errno : EIO;
        ibv_destroy_cq(q->cq);
        free(q);
        return isw_fail(err, "cannot create a queue pair on %s", r->name);
    }
    if (getrandom(&q->psn, sizeof q->psn, 0) != (ssize_t)sizeof q->psn)
        q->psn = (uint32_t)time(NULL);
    q->psn &= 0xFFFFFF;
    q->qpn = q->qp->qp_num;
    memset(local, 0, sizeof *local);
    local->qpn = q->qp->qp_num;
    local->psn = q->psn;
    local->lid = r->port_attr.lid;
    local->mtu = (uint8_t)r->port_attr.active_mtu;
    local->global = (uint8_t)r->global;
    memcpy(local->gid, r->gid.raw, ISW_RDMA_GID_LEN);
    *out = q;
    return 0;
}

static int verbs_qp_connect(struct isw_rdma_qp *q, const struct isw_rdma_qp_info *remote)
{
    struct isw_rdma *r = q->r;
    struct ibv_qp_attr a;

    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = (uint8_t)r->port;
    a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
    if (ibv_modify_qp(q->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
        return isw_fail(EIO, "queue pair %u of %s: RESET -> INIT refused", q->qp->qp_num, r->name);

    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = remote->mtu && remote->mtu < r->port_attr.active_mtu ? (enum ibv_mtu)remote->mtu
                                                                      : r->port_attr.active_mtu;
    a.dest_qp_num = remote->qpn;
    a.rq_psn = remote->psn;
    a.max_dest_rd_atomic = (uint8_t)r->rd_atomic;
    a.min_rnr_timer = 12;
    a.ah_attr.dlid = remote->lid;
    a.ah_attr.port_num = (uint8_t)r->port;
    if (r->global || remote->global || remote->lid == 0) {
        a.ah_attr.is_global = 1;
        memcpy(a.ah_attr.grh.dgid.raw, remote->gid, ISW_RDMA_GID_LEN);
        a.ah_attr.grh.sgid_index = (uint8_t)r->gid_index;
        a.ah_attr.grh.hop_limit = 1;
    }
    if (ibv_modify_qp(q->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN
                      | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
        return isw_fail(EIO, "queue pair %u of %s: INIT -> RTR towards %u refused", q->qp->qp_num,
                        r->name, remote->qpn);

    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.sq_psn = q->psn;
    a.max_rd_atomic = (uint8_t)r->rd_atomic;
    if (ibv_modify_qp(q->qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY
                      | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
        return isw_fail(EIO, "queue pair %u of %s: RTR -> RTS refused", q->qp->qp_num, r->name);
    return 0;
}

static void verbs_qp_destroy(struct isw_rdma_qp *q)
{
    ibv_destroy_qp(q->qp);
    ibv_destroy_cq(q->cq);
}

/* Post one signalled READ or WRITE and wait for its completion: 0, or -EIO / -ETIMEDOUT
 * with a message (the queue pair is then unusable). */
static int verbs_transfer(struct isw_rdma_qp *q, int write, void *local, uint32_t lkey,
                          uint32_t len, uint64_t remote_addr, uint32_t rkey)
{
    enum ibv_wr_opcode op = write ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
    struct ibv_sge sge = { .addr = (uintptr_t)local, .length = len, .lkey = lkey };
    struct ibv_send_wr wr, *bad = NULL;
    struct ibv_wc wc;
    struct timespec start, now;

    memset(&wr, 0, sizeof wr);
    wr.wr_id = 1;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = op;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = remote_addr;
    wr.wr.rdma.rkey = rkey;
    int rc = ibv_post_send(q->qp, &wr, &bad);
    if (rc != 0)
        return isw_fail(rc, "cannot post an RDMA %s: %s", op == IBV_WR_RDMA_READ ? "READ" : "WRITE",
                        isw_strerror(-rc));
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        int n = ibv_poll_cq(q->cq, 1, &wc);
        if (n < 0)
            return isw_fail(EIO, "polling the completion queue failed");
        if (n > 0)
            break;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((now.tv_sec - start.tv_sec) * 1000000000LL + (now.tv_nsec - start.tv_nsec) > OP_TIMEOUT_NS)
            return isw_fail(ETIMEDOUT, "an RDMA operation did not complete in 10 s");
    }
    if (wc.status != IBV_WC_SUCCESS)
        return isw_fail(EIO, "RDMA %s failed: %s (vendor error %u)",
                        op == IBV_WR_RDMA_READ ? "READ" : "WRITE", ibv_wc_status_str(wc.status),
                        wc.vendor_err);
    return 0;
}

#else  /* no libibverbs */

int isw_rdma_built(void)
{
    return 0;
}

int isw_rdma_device_count(void)
{
    return 0;
}

int isw_rdma_open(const char *name, int port, int gid_index, struct isw_rdma **out)
{
    (void)name, (void)port, (void)gid_index;
    *out = NULL;
    return isw_fail(ENOTSUP, NOT_BUILT);
}

static int verbs_qp_create(struct isw_rdma *r, struct isw_rdma_qp **out, struct isw_rdma_qp_info *local)
{
    (void)r, (void)out, (void)local;
    return isw_fail(ENOTSUP, NOT_BUILT);
}

static int verbs_qp_connect(struct isw_rdma_qp *q, const struct isw_rdma_qp_info *remote)
{
    (void)q, (void)remote;
    return isw_fail(ENOTSUP, NOT_BUILT);
}

static void verbs_qp_destroy(struct isw_rdma_qp *q)
{
    (void)q;
}

static int verbs_transfer(struct isw_rdma_qp *q, int write, void *local, uint32_t lkey,
                          uint32_t len, uint64_t remote_addr, uint32_t rkey)
{
    (void)q, (void)write, (void)local, (void)lkey, (void)len, (void)remote_addr, (void)rkey;
    return isw_fail(ENOTSUP, NOT_BUILT);
}

#endif

/* ---- queue pairs: the fake fabric or the device's verbs ---- */

int isw_rdma_qp_create(struct isw_rdma *r, struct isw_rdma_qp **out, struct isw_rdma_qp_info *local)
{
    int rc = r->fake ? fake_qp_create(r, out, local) : verbs_qp_create(r, out, local);
    if (rc == 0)
        atomic_fetch_add(&r->refs, 1);
    return rc;
}

int isw_rdma_qp_connect(struct isw_rdma_qp *q, const struct isw_rdma_qp_info *remote)
{
    return q->r->fake ? fake_qp_connect(q, remote) : verbs_qp_connect(q, remote);
}

void isw_rdma_qp_destroy(struct isw_rdma_qp *q)
{
    if (q == NULL)
        return;
    struct isw_rdma *r = q->r;
    if (r->fake)
        fake_qp_destroy(q);
    else
        verbs_qp_destroy(q);
    free(q);
    rdma_put(r);
}

static int qp_transfer(struct isw_rdma_qp *q, int write, void *local, uint32_t lkey, uint32_t len,
                       uint64_t remote_addr, uint32_t rkey)
{
    return q->r->fake ? fake_transfer(q, write, local, lkey, len, remote_addr, rkey)
                      : verbs_transfer(q, write, local, lkey, len, remote_addr, rkey);
}

/* ---- the remote ---- */

struct slab_lease {
    uint64_t gen;
    uint64_t addr;
    uint32_t rkey;
    int lent;
};

struct rdma_remote {
    struct isw_remote base;
    struct isw_rdma_qp *q;                   /* owned */
    pthread_mutex_t mu;                      /* one operation at a time; the leases */
    unsigned char *bounce;                   /* registered, BOUNCE_SIZE bytes */
    uint32_t bounce_lkey;
    uint64_t nslots;
    struct slab_lease *leases;
};

static const struct isw_remote_ops rdma_ops;

int isw_remote_rdma_set_slab(struct isw_remote *r, uint64_t slot, uint64_t gen, uint64_t addr,
                             uint32_t rkey)
{
    struct rdma_remote *m = (struct rdma_remote *)r;
    if (r->ops != &rdma_ops)
        return isw_fail(EINVAL, "remote %s is not an RDMA remote", r->desc);
    if (slot >= m->nslots)
        return isw_fail(ERANGE, "slot %llu is outside the %llu slots of %s", (unsigned long long)slot,
                        (unsigned long long)m->nslots, r->desc);
    pthread_mutex_lock(&m->mu);
    m->leases[slot] = (struct slab_lease){ .gen = gen, .addr = addr, .rkey = rkey, .lent = 1 };
    pthread_mutex_unlock(&m->mu);
    return 0;
}

/* READ or WRITE [off, off + len) of one slab through the bounce buffer, under m->mu. */
static int rdma_copy(struct isw_remote *r, uint64_t off, uint64_t gen, unsigned char *buf,
                     size_t len, int write)
{
    struct rdma_remote *m = (struct rdma_remote *)r;
    const char *what = write ? "WRITE" : "READ";
    uint64_t slot = off / r->slab_size, within = off % r->slab_size;

    if (len == 0 || slot >= m->nslots || within + len > r->slab_size)
        return isw_remote_error(r, 0, ERANGE, "region [%llu, +%zu) is not inside one slab",
                                (unsigned long long)off, len);
    pthread_mutex_lock(&m->mu);
    struct slab_lease lease = m->leases[slot];
    int rc = 0;
    if (!lease.lent || lease.gen != gen)
        rc = isw_remote_error(r, 0, ESTALE, "%s at region offset %llu refused: the slab is not lent "
                              "at generation %llu", what, (unsigned long long)off,
                              (unsigned long long)gen);
    for (size_t done = 0; rc == 0 && done < len;) {
        size_t n = len - done < BOUNCE_SIZE ? len - done : BOUNCE_SIZE;
        if (write)
            memcpy(m->bounce, buf + done, n);
        rc = qp_transfer(m->q, write, m->bounce, m->bounce_lkey, (uint32_t)n,
                         lease.addr + within + done, lease.rkey);
        if (rc < 0) {
            /* the queue pair is in error now (a revoked slab ends here too): the remote dies */
            rc = isw_remote_error(r, 1, -rc, "%s at region offset %llu: %s", what,
                                  (unsigned long long)off, isw_last_error());
            break;
        }
        if (!write)
            memcpy(buf + done, m->bounce, n);
        done += n;
    }
    pthread_mutex_unlock(&m->mu);
    return rc;
}

static int rdma_read(struct isw_remote *r, uint64_t off, uint64_t gen, void *buf, size_t len)
{
    return rdma_copy(r, off, gen, buf, len, 0);
}

static int rdma_write(struct isw_remote *r, uint64_t off, uint64_t gen, const void *buf, size_t len)
{
    return rdma_copy(r, off, gen, (unsigned char *)buf, len, 1);
}

static void rdma_destroy(struct isw_remote *r)
{
    struct rdma_remote *m = (struct rdma_remote *)r;
    isw_rdma_dereg(m->q->r, m->bounce, BOUNCE_SIZE);
    isw_rdma_qp_destroy(m->q);                 /* may free the device: after its last use */
    free(m->bounce);
    free(m->leases);
    pthread_mutex_destroy(&m->mu);
    isw_remote_fini(r);
    free(m);
}

static const struct isw_remote_ops rdma_ops = {
    .kind = "rdma", .read = rdma_read, .write = rdma_write, .destroy = rdma_destroy,
};

int isw_remote_rdma_open(struct isw_rdma_qp *q, uint64_t nslots, uint64_t slab_size,
                         struct isw_remote **out)
{
    char desc[160];
    uint32_t rkey;
    int rc;

    if (nslots == 0 || slab_size == 0 || nslots > UINT64_MAX / slab_size) {
        isw_rdma_qp_destroy(q);
        return isw_fail(EINVAL, "an RDMA remote needs slots and a slab size");
    }
    struct rdma_remote *m = calloc(1, sizeof *m);
    if (m != NULL)
        m->leases = calloc(nslots, sizeof *m->leases);
    if (m != NULL && posix_memalign((void **)&m->bounce, 4096, BOUNCE_SIZE) != 0)
        m->bounce = NULL;
    if (m == NULL || m->leases == NULL || m->bounce == NULL)
        rc = isw_fail(ENOMEM, "out of memory");
    else
        rc = isw_rdma_reg(q->r, m->bounce, BOUNCE_SIZE, 1, &m->bounce_lkey, &rkey);
    if (rc < 0) {
        if (m != NULL) {
            free(m->leases);
            free(m->bounce);
            free(m);
        }
        isw_rdma_qp_destroy(q);
        return rc;
    }
    pthread_mutex_init(&m->mu, NULL);
    m->q = q;
    m->nslots = nslots;
    snprintf(desc, sizeof desc, "rdma:%s/qp%u", q->r->name, q->qpn);
    isw_remote_init(&m->base, &rdma_ops, nslots * slab_size, slab_size, desc);
    *out = &m->base;
    return 0;
}

/* The steps of isw_rdma_selftest once the slab is registered: 0 or -errno (recorded). */
static int selftest_remote(struct isw_rdma *r, unsigned char *slab, uint64_t slab_size, uint32_t rkey,
                           struct isw_remote **remote, struct isw_rdma_qp **peer)
{
    struct isw_rdma_qp *a = NULL, *b = NULL;
    struct isw_rdma_qp_info ia, ib;
    unsigned char *back = malloc(slab_size);
    int rc;

    if (back == NULL)
        return isw_fail(ENOMEM, "out of memory");
    rc = isw_rdma_qp_create(r, &a, &ia);
    if (rc == 0)
        rc = isw_rdma_qp_create(r, &b, &ib);
    if (rc == 0)
        rc = isw_rdma_qp_connect(a, &ib);
    if (rc == 0)
        rc = isw_rdma_qp_connect(b, &ia);
    if (rc == 0) {
        rc = isw_remote_rdma_open(a, 1, slab_size, remote);     /* takes a over */
        a = NULL;
    }
    *peer = b;                         /* answers a's operations: kept until the end */
    if (rc < 0) {
        isw_rdma_qp_destroy(a);
        free(back);
        return rc;
    }
    for (uint64_t i = 0; i < slab_size; i++)
        back[i] = (unsigned char)(i * 7 + 3);
    isw_remote_rdma_set_slab(*remote, 0, 1, (uintptr_t)slab, rkey);
    rc = (*remote)->ops->write(*remote, 0, 1, back, slab_size);
    if (rc == 0 && memcmp(slab, back, slab_size) != 0)
        rc = isw_fail(EIO, "selftest: an RDMA WRITE did not land in the slab");
    if (rc == 0) {
        memset(back, 0, slab_size);
        rc = (*remote)->ops->read(*remote, 0, 1, back, slab_size);
    }
    if (rc == 0 && memcmp(slab, back, slab_size) != 0)
        rc = isw_fail(EIO, "selftest: an RDMA READ did not return the slab");
    if (rc == 0 && (*remote)->ops->read(*remote, 0, 2, back, 4096) != -ESTALE)
        rc = isw_fail(EIO, "selftest: a stale generation was not refused");
    free(back);
    return rc;
}

int isw_rdma_selftest(struct isw_rdma *r, uint64_t slab_size)
{
    struct isw_remote *remote = NULL;
    struct isw_rdma_qp *peer = NULL;
    unsigned char *slab;
    uint32_t lkey, rkey;
    int rc;

    if (slab_size == 0 || slab_size > ((uint64_t)1 << 30))
        return isw_fail(EINVAL, "selftest: slab size must be in 1..1 GiB");
    if (posix_memalign((void **)&slab, 4096, slab_size) != 0)
        return isw_fail(ENOMEM, "out of memory");
    memset(slab, 0, slab_size);
    rc = isw_rdma_reg(r, slab, slab_size, 1, &lkey, &rkey);
    if (rc == 0) {
        rc = selftest_remote(r, slab, slab_size, rkey, &remote, &peer);
        isw_rdma_dereg(r, slab, slab_size);          /* the slab is taken back */
    }
    if (rc == 0) {
        unsigned char page[4096];
        if (remote->ops->read(remote, 0, 1, page, sizeof page) == 0)
            rc = isw_fail(EIO, "selftest: a READ after deregistration succeeded (no fence)");
        else if (!atomic_load(&remote->dead))
            rc = isw_fail(EIO, "selftest: a READ after deregistration failed but left the remote alive");
        else
            isw_clear_error();
    }
    if (remote != NULL)
        remote->ops->destroy(remote);
    isw_rdma_qp_destroy(peer);
    free(slab);
    return rc;
}
