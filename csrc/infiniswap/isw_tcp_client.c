/*
 * isw_tcp_client.c — remote over TCP: a few pipelined connections to a daemon's data server
 * (isw_dataserver.c, wire format in isw_proto.h).
 *
 * Owns: the connection sockets, the queue of requests in flight on each, their receive
 * buffers, and the request ids.
 *
 * Any number of threads share a connection (picked round robin).  A request is sent whole
 * under the connection's send lock and queued, in send order, under its mutex; the server
 * answers the requests of a connection in order, so the next reply always belongs to the
 * oldest request in the queue.  The replies are read by one of the waiting threads at a
 * time (leader/followers): it receives into the connection's buffer — several replies per
 * receive when the server batched them — copies each payload to its request's buffer (a
 * large remainder is received straight into it), wakes its thread, and goes on until its
 * own reply came; then a waiting thread takes over the reading.  So requests from several
 * threads reach the server back to back, and it can serve them with one receive and one
 * send (that is what takes the server's CPU per page down), while a lone request still
 * costs one send and one receive here.
 *
 * Each connection proves the cluster key to the data server, and the server proves it
 * back, before the first request (isw_auth_client, isw_auth.h): a server that cannot is
 * refused, so no page is ever written to (or read from) a daemon outside the cluster.
 *
 * Socket timeouts bound every send and receive, so a dead or hung daemon gives an error,
 * never a hang.  A transport error (or a reply that breaks the protocol) fails every
 * request queued on that connection and marks the whole remote dead; a status error from
 * the server (e.g. the region is no longer allocated) fails that request only.
 */
#include "isw_auth.h"
#include "isw_net.h"
#include "isw_proto.h"
#include "isw_remote.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define ISW_CLIENT_RX_BUF (64u << 10)   /* a connection's receive buffer */
#define ISW_CLIENT_DIRECT_MIN (16u << 10)   /* payload rests this large go straight to the caller */

struct waiter {
    struct waiter *next;
    uint64_t id;
    uint16_t op;
    unsigned char *buf;
    uint32_t len;
    int done;                   /* under the connection's mutex */
    int rc, transport;          /* the result, once done */
    pthread_cond_t cv;
};

struct conn {
    int fd;
    pthread_mutex_t send_mu;    /* one sender at a time; taken before mu */
    pthread_mutex_t mu;         /* the queue, reading, broken */
    struct waiter *head, *tail; /* requests sent (or being sent) without a reply, in order */
    int reading;                /* one waiter reads replies */
    int broken;                 /* a transport error happened: -errno, else 0 */
    unsigned char *rx;          /* rx[rhead, rtail): received, not yet consumed (reader) */
    size_t rhead, rtail;
};

struct tcp_remote {
    struct isw_remote base;
    int nconn;
    struct conn *conns;
    _Atomic uint64_t next_id;
    _Atomic unsigned next_conn;
};

/* ---------- the queue (under c->mu) ---------- */

static void complete(struct waiter *w, int rc, int transport)
{
    w->rc = rc;
    w->transport = transport;
    w->done = 1;
    pthread_cond_signal(&w->cv);
}

static struct waiter *pop(struct conn *c)
{
    struct waiter *w = c->head;
    c->head = w->next;
    if (c->head == NULL)
        c->tail = NULL;
    return w;
}

/* A transport error on c: every queued request fails with it.  Only the reader completes
 * requests while there is one (it may be writing into the oldest one's buffer); the
 * shutdown wakes it out of its receive, and it fails them all.  The socket is closed only
 * when the remote is. */
static void break_conn(struct conn *c, int rc, int by_reader)
{
    pthread_mutex_lock(&c->mu);
    if (c->broken == 0) {
        c->broken = rc;
        shutdown(c->fd, SHUT_RDWR);
    }
    if (by_reader || !c->reading)
        while (c->head != NULL)
            complete(pop(c), c->broken, 1);
    pthread_mutex_unlock(&c->mu);
}

/* ---------- the reader's side ---------- */

/* At least `n` bytes in the buffer (n <= its size); 0 or a transport error. */
static int rx_need(struct conn *c, size_t n)
{
    if (c->rtail - c->rhead >= n)
        return 0;
    if (c->rhead > 0) {
        memmove(c->rx, c->rx + c->rhead, c->rtail - c->rhead);
        c->rtail -= c->rhead;
        c->rhead = 0;
    }
    while (c->rtail < n) {
        ssize_t got = recv(c->fd, c->rx + c->rtail, ISW_CLIENT_RX_BUF - c->rtail, 0);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0)
            return errno == EAGAIN || errno == EWOULDBLOCK ? -ETIMEDOUT : -errno;
        if (got == 0)
            return -ECONNRESET;
        c->rtail += (size_t)got;
    }
    return 0;
}

/* The payload of a successful READ reply into w's buffer. */
static int take_payload(struct conn *c, struct waiter *w)
{
    size_t done = 0;

    while (done < w->len) {
        size_t have = c->rtail - c->rhead, left = w->len - done;
        if (have > 0) {
            size_t n = have < left ? have : left;
            memcpy(w->buf + done, c->rx + c->rhead, n);
            c->rhead += n;
            done += n;
        } else if (left >= ISW_CLIENT_DIRECT_MIN) {
            return isw_recv_all(c->fd, w->buf + done, left);
        } else {
            int rc = rx_need(c, 1);
            if (rc < 0)
                return rc;
        }
    }
    return 0;
}

/* Read the next reply and complete its request.  0, or a transport/protocol error. */
static int read_reply(struct conn *c)
{
    struct isw_rep rep;
    int rc = rx_need(c, ISW_PROTO_REP_SIZE);

    if (rc < 0)
        return rc;
    isw_rep_decode(c->rx + c->rhead, &rep);
    c->rhead += ISW_PROTO_REP_SIZE;
    pthread_mutex_lock(&c->mu);
    struct waiter *w = c->head;         /* the oldest request: its reply comes first */
    pthread_mutex_unlock(&c->mu);
    if (w == NULL || rep.magic != ISW_PROTO_REPLY_MAGIC || rep.req_id != w->id ||
        rep.status > 0)
        return -EPROTO;
    /* w stays queued (and its thread waiting) until it is completed below */
    if (rep.status == 0 && w->op == ISW_OP_READ) {
        rc = take_payload(c, w);
        if (rc < 0)
            return rc;
    }
    pthread_mutex_lock(&c->mu);
    complete(pop(c), rep.status, 0);
    pthread_mutex_unlock(&c->mu);
    return 0;
}

/* Wait until `me` is completed, reading replies while no other waiter does. */
static void wait_reply(struct conn *c, struct waiter *me)
{
    pthread_mutex_lock(&c->mu);
    while (!me->done) {
        if (c->reading) {
            pthread_cond_wait(&me->cv, &c->mu);
            continue;
        }
        c->reading = 1;
        while (!me->done) {
            pthread_mutex_unlock(&c->mu);
            int rc = read_reply(c);
            if (rc < 0)
                break_conn(c, rc, 1);
            pthread_mutex_lock(&c->mu);
        }
        c->reading = 0;
        if (c->head != NULL)            /* hand the reading over */
            pthread_cond_signal(&c->head->cv);
    }
    pthread_mutex_unlock(&c->mu);
}

/* ---------- requests ---------- */

/* One request/reply on c.  Returns 0, a server status (< 0, *transport = 0) or a
 * transport error (< 0, *transport = 1). */
static int tcp_one(struct tcp_remote *t, struct conn *c, uint16_t op, uint64_t off,
                   uint64_t gen, unsigned char *buf, uint32_t len, int *transport)
{
    unsigned char hb[ISW_PROTO_REQ_SIZE];
    struct waiter me = { .id = atomic_fetch_add(&t->next_id, 1), .op = op, .buf = buf,
                         .len = len };
    struct isw_req q = {
        .magic = ISW_PROTO_MAGIC, .version = ISW_PROTO_VERSION, .op = op,
        .region_offset = off, .length = len, .req_id = me.id, .gen = gen,
    };
    struct iovec iov[2] = { { hb, sizeof hb }, { buf, len } };
    int rc;

    isw_req_encode(&q, hb);
    *transport = 1;
    pthread_mutex_lock(&c->send_mu);
    pthread_mutex_lock(&c->mu);
    rc = c->broken;
    if (rc == 0) {                      /* queued in send order */
        pthread_cond_init(&me.cv, NULL);
        if (c->tail != NULL)
            c->tail->next = &me;
        else
            c->head = &me;
        c->tail = &me;
    }
    pthread_mutex_unlock(&c->mu);
    if (rc < 0) {                       /* broken by an earlier error: not queued */
        pthread_mutex_unlock(&c->send_mu);
        return rc;
    }
    rc = isw_send_all(c->fd, iov, op == ISW_OP_WRITE ? 2 : 1);
    pthread_mutex_unlock(&c->send_mu);
    if (rc < 0)
        break_conn(c, rc, 0);           /* me is completed by it, or by the reader */
    wait_reply(c, &me);
    pthread_cond_destroy(&me.cv);
    *transport = me.transport;
    return me.rc;
}

/* What a status the data server returned means for us. */
static const char *status_text(int rc, int transport)
{
    if (!transport && rc == -EFAULT)
        return "the region is not an allocated slab of the daemon";
    if (!transport && rc == -ERANGE)
        return "the region is outside the daemon's store";
    if (!transport && rc == -ESTALE)
        return "the daemon took the slab back (the lease's generation is no longer valid)";
    return isw_strerror(rc);
}

static int tcp_xfer(struct isw_remote *r, uint16_t op, uint64_t off, uint64_t gen, void *buf,
                    size_t len)
{
    struct tcp_remote *t = (struct tcp_remote *)r;
    unsigned char *p = buf;
    int rc = 0, transport = 0;

    if (atomic_load(&r->dead)) {
        char why[256];
        isw_remote_last_error(r, why, sizeof why);
        return isw_fail(EIO, "remote %s is dead after an earlier error (%s)", r->desc, why);
    }
    struct conn *c = &t->conns[atomic_fetch_add(&t->next_conn, 1) % (unsigned)t->nconn];
    while (len > 0) {
        uint32_t n = len > ISW_PROTO_CHUNK ? ISW_PROTO_CHUNK : (uint32_t)len;
        rc = tcp_one(t, c, op, off, gen, p, n, &transport);
        if (rc < 0)
            break;
        p += n;
        off += n;
        len -= n;
    }
    if (rc < 0)
        return isw_remote_error(r, transport, -rc, "%s at region offset %llu failed: %s%s",
                                op == ISW_OP_READ ? "READ" : "WRITE", (unsigned long long)off,
                                status_text(rc, transport),
                                transport ? " (remote marked dead)" : "");
    return 0;
}

static int tcp_read(struct isw_remote *r, uint64_t off, uint64_t gen, void *buf, size_t len)
{
    return tcp_xfer(r, ISW_OP_READ, off, gen, buf, len);
}

static int tcp_write(struct isw_remote *r, uint64_t off, uint64_t gen, const void *buf,
                     size_t len)
{
    /* The buffer is only sent, never written: the cast is safe. */
    return tcp_xfer(r, ISW_OP_WRITE, off, gen, (void *)buf, len);
}

static void conns_free(struct conn *conns, int n)
{
    for (int i = 0; i < n; i++) {
        close(conns[i].fd);
        free(conns[i].rx);
        pthread_mutex_destroy(&conns[i].send_mu);
        pthread_mutex_destroy(&conns[i].mu);
    }
    free(conns);
}

static void tcp_destroy(struct isw_remote *r)
{
    struct tcp_remote *t = (struct tcp_remote *)r;
    conns_free(t->conns, t->nconn);
    isw_remote_fini(r);
    free(t);
}

static const struct isw_remote_ops tcp_ops = {
    .kind = "tcp", .read = tcp_read, .write = tcp_write, .destroy = tcp_destroy,
};

/* Connect one connection and complete the handshake on it; 0 or -errno (recorded). */
static int connect_proven(const char *host, int port, int timeout_ms, int rto_min_us,
                          const unsigned char *key, size_t key_len, int *out_fd)
{
    char why[256];
    int fd, rc = isw_tcp_connect(host, port, timeout_ms, rto_min_us, &fd);

    if (rc < 0)
        return rc;
    rc = isw_auth_client(fd, key, key_len);
    if (rc < 0) {
        snprintf(why, sizeof why, "%s", isw_last_error());
        close(fd);
        return isw_fail(-rc, "data server %s:%d: %s", host, port, why);
    }
    *out_fd = fd;
    return 0;
}

int isw_remote_tcp_open(const char *host, int port, int connections, int timeout_ms,
                        int rto_min_us, const unsigned char *key, size_t key_len,
                        struct isw_remote **out)
{
    char desc[160];
    int rc = 0, opened = 0;

    if (connections < 1 || connections > 256)
        return isw_fail(EINVAL, "connections must be 1..256, got %d", connections);
    if (timeout_ms < 1)
        return isw_fail(EINVAL, "timeout must be at least 1 ms, got %d", timeout_ms);
    if (rto_min_us < 0 || rto_min_us > ISW_RTO_MIN_MAX_US)
        return isw_fail(EINVAL, "the retransmission-timeout floor must be 0..%d us, got %d",
                        ISW_RTO_MIN_MAX_US, rto_min_us);
    if (isw_auth_check_key(key, key_len) < 0)
        return -EINVAL;
    struct tcp_remote *t = calloc(1, sizeof *t);
    struct conn *conns = calloc((size_t)connections, sizeof *conns);
    if (t == NULL || conns == NULL) {
        free(t);
        free(conns);
        return isw_fail(ENOMEM, "out of memory");
    }
    for (; opened < connections; opened++) {
        struct conn *c = &conns[opened];
        c->rx = malloc(ISW_CLIENT_RX_BUF);
        rc = c->rx == NULL ? isw_fail(ENOMEM, "out of memory")
                           : connect_proven(host, port, timeout_ms, rto_min_us, key, key_len,
                                            &c->fd);
        if (rc < 0) {
            free(c->rx);
            break;
        }
        pthread_mutex_init(&c->send_mu, NULL);
        pthread_mutex_init(&c->mu, NULL);
    }
    if (rc < 0) {
        conns_free(conns, opened);
        free(t);
        return rc;
    }
    t->nconn = connections;
    t->conns = conns;
    atomic_init(&t->next_id, 1);
    atomic_init(&t->next_conn, 0);
    snprintf(desc, sizeof desc, "tcp:%s:%d", host, port);
    isw_remote_init(&t->base, &tcp_ops, UINT64_MAX, 0, desc);
    t->base.rto_min_us = isw_tcp_rto_min(conns[0].fd);
    *out = &t->base;
    return 0;
}
