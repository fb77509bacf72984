/*
 * isw_dataserver.c — TCP data server of the daemon (see isw_dataserver.h, isw_proto.h).
 *
 * Owns: the listening socket, the wake pipe, the accept and connection threads and the
 * request counters.  It uses the store's memory but not the store (isw_store_acquire keeps
 * it alive).
 *
 * Threads: the accept thread polls the listening socket and a wake pipe; each connection
 * has a thread that reads a request, validates it against the store, and replies.  Payloads
 * pass through a buffer of the connection: a WRITE is received there and then copied into
 * the slab, a READ copied out of the slab and then sent, each copy inside the slab's fence
 * window (isw_store_access), so a revoke never waits for the network.  A
 * connection thread never closes its own socket (the fd number could be reused while
 * stop() shuts it down); finished connections are joined and closed by the accept thread
 * (woken through the pipe) or by stop().
 */
#include "isw_dataserver.h"
#include "isw_common.h"
#include "isw_net.h"
#include "isw_proto.h"
#include "isw_store.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

struct conn {
    struct conn *next;
    struct isw_server *srv;
    int fd;
    int done;                   /* under srv->mu */
    pthread_t th;
    unsigned char *buf;         /* payload buffer of this connection's thread */
    size_t buf_size;
};

struct isw_server {
    struct isw_store *store;
    int lfd;
    int wake[2];
    int port;
    pthread_t accept_th;
    pthread_mutex_t mu;
    struct conn *conns;         /* under mu */
    int stopping;               /* under mu */
    atomic_int stopped;
    _Atomic uint64_t connections, active, requests, reads, writes, bytes_read, bytes_written,
        errors;
};

static void wake(struct isw_server *srv)
{
    char c = 'w';
    ssize_t n = write(srv->wake[1], &c, 1);  /* pipe full is fine: a wake is pending */
    (void)n;
}

/* The connection's payload buffer, at least `len` bytes; NULL if out of memory. */
static unsigned char *conn_buffer(struct conn *c, size_t len)
{
    if (c->buf_size < len) {
        unsigned char *b = realloc(c->buf, len);
        if (b == NULL)
            return NULL;
        c->buf = b;
        c->buf_size = len;
    }
    return c->buf;
}

/* The status of a well-formed request: 0 or -errno; *fatal when the stream is not. */
static int request_status(const struct isw_req *q, int *fatal)
{
    *fatal = 1;
    if (q->magic != ISW_PROTO_MAGIC)
        return -EPROTO;
    if (q->version != ISW_PROTO_VERSION)
        return -EPROTONOSUPPORT;
    if (q->op != ISW_OP_READ && q->op != ISW_OP_WRITE)
        return -EOPNOTSUPP;
    if (q->length == 0 || q->length > ISW_PROTO_MAX_LEN)
        return -EMSGSIZE;
    *fatal = 0;
    return 0;
}

/* Serve one request.  Returns 0 to go on, < 0 to close the connection. */
static int serve_one(struct conn *c)
{
    struct isw_server *srv = c->srv;
    unsigned char hb[ISW_PROTO_REQ_SIZE], rb[ISW_PROTO_REP_SIZE];
    struct isw_req q;
    unsigned char *buf = NULL;
    int status, fatal, rc;

    rc = isw_recv_all(c->fd, hb, sizeof hb);
    if (rc < 0)
        return rc;
    isw_req_decode(hb, &q);
    atomic_fetch_add(&srv->requests, 1);
    status = request_status(&q, &fatal);
    if (!fatal && (buf = conn_buffer(c, q.length)) == NULL)
        status = -ENOMEM;
    if (!fatal && q.op == ISW_OP_WRITE) {
        atomic_fetch_add(&srv->writes, 1);
        rc = buf != NULL ? isw_recv_all(c->fd, buf, q.length) : isw_recv_discard(c->fd, q.length);
        if (rc < 0)
            return rc;
        if (status == 0)
            status = isw_store_access(srv->store, q.region_offset, q.length, q.gen, buf, 1);
        if (status == 0)
            atomic_fetch_add(&srv->bytes_written, q.length);
    } else if (!fatal) {
        atomic_fetch_add(&srv->reads, 1);
        if (status == 0)
            status = isw_store_access(srv->store, q.region_offset, q.length, q.gen, buf, 0);
    }
    if (status != 0)
        atomic_fetch_add(&srv->errors, 1);
    struct isw_rep rep = { .magic = ISW_PROTO_REPLY_MAGIC, .status = status, .req_id = q.req_id };
    isw_rep_encode(&rep, rb);
    struct iovec iov[2] = { { rb, sizeof rb }, { buf, q.length } };
    int with_payload = status == 0 && q.op == ISW_OP_READ;
    rc = isw_send_all(c->fd, iov, with_payload ? 2 : 1);
    if (rc < 0)
        return rc;
    if (with_payload)
        atomic_fetch_add(&srv->bytes_read, q.length);
    return fatal ? -EPROTO : 0;
}

static void *conn_main(void *arg)
{
    struct conn *c = arg;
    struct isw_server *srv = c->srv;

    while (serve_one(c) == 0)
        ;
    shutdown(c->fd, SHUT_RDWR);
    pthread_mutex_lock(&srv->mu);
    c->done = 1;
    pthread_mutex_unlock(&srv->mu);
    atomic_fetch_sub(&srv->active, 1);
    wake(srv);
    return NULL;
}

/* Join and free finished connections (all of them when `all`).  Not under mu. */
static void reap(struct isw_server *srv, int all)
{
    for (;;) {
        struct conn *victim = NULL, **pp;
        pthread_mutex_lock(&srv->mu);
        for (pp = &srv->conns; *pp != NULL; pp = &(*pp)->next)
            if (all || (*pp)->done) {
                victim = *pp;
                *pp = victim->next;
                break;
            }
        pthread_mutex_unlock(&srv->mu);
        if (victim == NULL)
            return;
        pthread_join(victim->th, NULL);
        close(victim->fd);
        free(victim->buf);
        free(victim);
    }
}

static void *accept_main(void *arg)
{
    struct isw_server *srv = arg;
    struct pollfd pfd[2] = { { .fd = srv->lfd, .events = POLLIN }, { .fd = srv->wake[0], .events = POLLIN } };

    for (;;) {
        int pr = poll(pfd, 2, -1);
        if (pr < 0) {
            if (errno == EINTR)
                continue;
            isw_sleep_us(10000);
            continue;
        }
        if (pfd[1].revents) {
            char buf[64];
            while (read(srv->wake[0], buf, sizeof buf) > 0)
                ;
            pthread_mutex_lock(&srv->mu);
            int stopping = srv->stopping;
            pthread_mutex_unlock(&srv->mu);
            if (stopping)
                break;
            reap(srv, 0);
        }
        if (!(pfd[0].revents & POLLIN))
            continue;
        int fd = accept4(srv->lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
                isw_sleep_us(10000);    /* out of resources: back off, keep serving */
            continue;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        struct conn *c = calloc(1, sizeof *c);
        if (c == NULL) {
            close(fd);
            continue;
        }
        c->srv = srv;
        c->fd = fd;
        pthread_mutex_lock(&srv->mu);
        atomic_fetch_add(&srv->active, 1);
        if (isw_thread_start(&c->th, conn_main, c) < 0) {
            atomic_fetch_sub(&srv->active, 1);
            pthread_mutex_unlock(&srv->mu);
            close(fd);
            free(c);
            continue;
        }
        c->next = srv->conns;
        srv->conns = c;
        atomic_fetch_add(&srv->connections, 1);
        pthread_mutex_unlock(&srv->mu);
    }
    return NULL;
}

static int listen_on(const char *host, int port, int *out_fd, int *out_port)
{
    struct addrinfo hints, *res = NULL;
    char portstr[16];
    int rc = -EADDRNOTAVAIL;

    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    snprintf(portstr, sizeof portstr, "%d", port);
    int gai = getaddrinfo(host, portstr, &hints, &res);
    if (gai != 0)
        return isw_fail(EADDRNOTAVAIL, "cannot resolve listen address '%s': %s", host,
                        gai_strerror(gai));
    for (struct addrinfo *ai = res; ai != NULL; ai = ai->ai_next) {
        int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        int one = 1;
        if (fd < 0) {
            rc = -errno;
            continue;
        }
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(fd, 128) < 0) {
            rc = -errno;
            close(fd);
            continue;
        }
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        if (getsockname(fd, (struct sockaddr *)&ss, &sl) < 0) {
            rc = -errno;
            close(fd);
            continue;
        }
        *out_port = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                             : ntohs(((struct sockaddr_in *)&ss)->sin_port);
        *out_fd = fd;
        rc = 0;
        break;
    }
    freeaddrinfo(res);
    if (rc < 0)
        return isw_fail(-rc, "cannot listen on %s:%d: %s", host, port, isw_strerror(rc));
    return 0;
}

int isw_server_start(struct isw_store *store, const char *host, int port,
                     struct isw_server **out)
{
    int rc;

    if (port < 0 || port > 65535)
        return isw_fail(EINVAL, "port %d is not a TCP port (0..65535)", port);
    if (isw_store_fd(store) < 0)
        return isw_fail(EBADF, "the slab store is closed");
    struct isw_server *srv = calloc(1, sizeof *srv);
    if (srv == NULL)
        return isw_fail(ENOMEM, "out of memory");
    srv->store = store;
    srv->wake[0] = srv->wake[1] = -1;
    rc = listen_on(host, port, &srv->lfd, &srv->port);
    if (rc < 0) {
        free(srv);
        return rc;
    }
    if (pipe2(srv->wake, O_CLOEXEC | O_NONBLOCK) < 0) {
        rc = -errno;
        close(srv->lfd);
        free(srv);
        return isw_fail(-rc, "cannot create a pipe: %s", isw_strerror(rc));
    }
    pthread_mutex_init(&srv->mu, NULL);
    isw_store_acquire(store);
    rc = isw_thread_start(&srv->accept_th, accept_main, srv);
    if (rc < 0) {
        isw_store_release(store);
        pthread_mutex_destroy(&srv->mu);
        close(srv->lfd);
        close(srv->wake[0]);
        close(srv->wake[1]);
        free(srv);
        return isw_fail(-rc, "cannot start the accept thread: %s", isw_strerror(rc));
    }
    *out = srv;
    return 0;
}

int isw_server_port(struct isw_server *srv)
{
    return srv->port;
}

int isw_server_stop(struct isw_server *srv)
{
    if (atomic_exchange(&srv->stopped, 1))
        return 0;
    pthread_mutex_lock(&srv->mu);
    srv->stopping = 1;
    pthread_mutex_unlock(&srv->mu);
    wake(srv);
    pthread_join(srv->accept_th, NULL);
    close(srv->lfd);
    pthread_mutex_lock(&srv->mu);
    for (struct conn *c = srv->conns; c != NULL; c = c->next)
        shutdown(c->fd, SHUT_RDWR);
    pthread_mutex_unlock(&srv->mu);
    reap(srv, 1);
    close(srv->wake[0]);
    close(srv->wake[1]);
    isw_store_release(srv->store);      /* no thread touches the store any more */
    return 0;
}

void isw_server_free(struct isw_server *srv)
{
    if (srv == NULL)
        return;
    isw_server_stop(srv);
    pthread_mutex_destroy(&srv->mu);
    free(srv);
}

int isw_server_get_stats(struct isw_server *srv, struct isw_server_stats *out)
{
    out->connections = atomic_load(&srv->connections);
    out->active_connections = atomic_load(&srv->active);
    out->requests = atomic_load(&srv->requests);
    out->read_requests = atomic_load(&srv->reads);
    out->write_requests = atomic_load(&srv->writes);
    out->bytes_read = atomic_load(&srv->bytes_read);
    out->bytes_written = atomic_load(&srv->bytes_written);
    out->errors = atomic_load(&srv->errors);
    return 0;
}
