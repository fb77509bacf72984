/*
 * isw_tcp_client.c — remote over TCP: a small pool of blocking connections to a daemon's
 * data server (isw_dataserver.c, wire format in isw_proto.h).
 *
 * Owns: the connection sockets and the pool that hands them out, and the request ids.
 *
 * A request checks out one connection (mutex + condvar pool), sends the request in chunks
 * of at most ISW_PROTO_CHUNK bytes and waits for each reply.  Socket timeouts bound every
 * wait, so a dead or hung daemon gives an error, never a hang.  A transport error closes
 * that connection and marks the whole remote dead; a status error from the server (e.g. the
 * region is no longer allocated) is returned and the connection stays in use.
 */
#include "isw_net.h"
#include "isw_proto.h"
#include "isw_remote.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct tcp_remote {
    struct isw_remote base;
    int timeout_ms;
    int nconn;
    int *fds;           /* -1 once closed after an error */
    int *free_stack;    /* indices of idle connections */
    int nfree;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    _Atomic uint64_t next_id;
};

static int checkout(struct tcp_remote *t)
{
    pthread_mutex_lock(&t->mu);
    while (t->nfree == 0)
        pthread_cond_wait(&t->cv, &t->mu);
    int i = t->free_stack[--t->nfree];
    pthread_mutex_unlock(&t->mu);
    return i;
}

static void checkin(struct tcp_remote *t, int i)
{
    pthread_mutex_lock(&t->mu);
    t->free_stack[t->nfree++] = i;
    pthread_cond_signal(&t->cv);
    pthread_mutex_unlock(&t->mu);
}

/* One request/reply on fd.  Returns 0, a server status (< 0, *transport = 0) or a
 * transport error (< 0, *transport = 1). */
static int tcp_one(struct tcp_remote *t, int fd, uint16_t op, uint64_t off, uint64_t gen,
                   void *buf, uint32_t len, int *transport)
{
    unsigned char hb[ISW_PROTO_REQ_SIZE], rb[ISW_PROTO_REP_SIZE];
    struct isw_req q = {
        .magic = ISW_PROTO_MAGIC, .version = ISW_PROTO_VERSION, .op = op,
        .region_offset = off, .length = len, .req_id = atomic_fetch_add(&t->next_id, 1),
        .gen = gen,
    };
    struct iovec iov[2] = { { hb, sizeof hb }, { buf, len } };
    struct isw_rep rep;
    int rc;

    *transport = 1;
    isw_req_encode(&q, hb);
    rc = isw_send_all(fd, iov, op == ISW_OP_WRITE ? 2 : 1);
    if (rc < 0)
        return rc;
    rc = isw_recv_all(fd, rb, sizeof rb);
    if (rc < 0)
        return rc;
    isw_rep_decode(rb, &rep);
    if (rep.magic != ISW_PROTO_REPLY_MAGIC || rep.req_id != q.req_id)
        return -EPROTO;
    if (rep.status > 0)
        return -EPROTO;
    if (rep.status < 0) {
        *transport = 0;
        return rep.status;
    }
    if (op == ISW_OP_READ)
        return isw_recv_all(fd, buf, len);
    return 0;
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
    int i = checkout(t);
    int fd = t->fds[i];
    if (fd < 0) {
        checkin(t, i);
        return isw_remote_error(r, 1, ENOTCONN, "connection %d is closed", i);
    }
    while (len > 0) {
        uint32_t n = len > ISW_PROTO_CHUNK ? ISW_PROTO_CHUNK : (uint32_t)len;
        rc = tcp_one(t, fd, op, off, gen, p, n, &transport);
        if (rc < 0)
            break;
        p += n;
        off += n;
        len -= n;
    }
    if (rc < 0 && transport) {
        close(fd);
        t->fds[i] = -1;
    }
    checkin(t, i);
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

static void tcp_destroy(struct isw_remote *r)
{
    struct tcp_remote *t = (struct tcp_remote *)r;
    for (int i = 0; i < t->nconn; i++)
        if (t->fds[i] >= 0)
            close(t->fds[i]);
    free(t->fds);
    free(t->free_stack);
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    isw_remote_fini(r);
    free(t);
}

static const struct isw_remote_ops tcp_ops = {
    .kind = "tcp", .read = tcp_read, .write = tcp_write, .destroy = tcp_destroy,
};

int isw_remote_tcp_open(const char *host, int port, int connections, int timeout_ms,
                        struct isw_remote **out)
{
    char desc[160];
    int rc;

    if (connections < 1 || connections > 256)
        return isw_fail(EINVAL, "connections must be 1..256, got %d", connections);
    if (timeout_ms < 1)
        return isw_fail(EINVAL, "timeout must be at least 1 ms, got %d", timeout_ms);
    struct tcp_remote *t = calloc(1, sizeof *t);
    if (t == NULL)
        return isw_fail(ENOMEM, "out of memory");
    t->fds = malloc(sizeof(int) * (size_t)connections);
    t->free_stack = malloc(sizeof(int) * (size_t)connections);
    if (t->fds == NULL || t->free_stack == NULL) {
        free(t->fds);
        free(t->free_stack);
        free(t);
        return isw_fail(ENOMEM, "out of memory");
    }
    for (int i = 0; i < connections; i++)
        t->fds[i] = -1;
    for (int i = 0; i < connections; i++) {
        rc = isw_tcp_connect(host, port, timeout_ms, &t->fds[i]);
        if (rc < 0) {
            for (int j = 0; j < i; j++)
                close(t->fds[j]);
            free(t->fds);
            free(t->free_stack);
            free(t);
            return rc;
        }
        t->free_stack[i] = i;
    }
    t->nconn = connections;
    t->nfree = connections;
    t->timeout_ms = timeout_ms;
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    atomic_init(&t->next_id, 1);
    snprintf(desc, sizeof desc, "tcp:%s:%d", host, port);
    isw_remote_init(&t->base, &tcp_ops, UINT64_MAX, 0, desc);
    *out = &t->base;
    return 0;
}
