/*
 * isw_dataserver.c — TCP data server of the daemon (see isw_dataserver.h, isw_proto.h).
 *
 * Owns: the listening socket, the stop eventfd, the worker threads with their epoll sets
 * and connections, and the request counters.  It uses the store's memory but not the store
 * (isw_store_acquire keeps it alive).
 *
 * Threads: ISW_SERVER_WORKERS event loops.  Each has its own epoll set holding the
 * listening socket (EPOLLEXCLUSIVE: one worker is woken per connection attempt), the stop
 * eventfd and the nonblocking connections it accepted; it alone reads, writes and closes
 * them.  One epoll_wait hands a worker every connection that is ready, so a busy server
 * serves many requests per wake-up instead of one thread switch per request.
 *
 * Per connection, a turn (the connection was reported readable) is:
 *  1. receive into the connection's buffer (ISW_RX_BUF bytes): as many requests as the
 *     device pipelined, with WRITE payloads;
 *  2. serve every complete request in the buffer: a WRITE payload is copied into the slab
 *     (one that is not in the buffer yet, ISW_DIRECT_MIN bytes or more, is received
 *     straight into the slab: recv with MSG_DONTWAIT), a READ's bytes are copied out of the
 *     slab behind its reply header in the connection's reply buffer;
 *  3. send every reply of the turn with one nonblocking send.  What the socket does not
 *     take is sent when it is writable, and no further request is read meanwhile.
 * So a batch of pipelined requests costs one receive and one send, and a single request
 * one receive, one send and its share of an epoll_wait.  Only copies are inside a slab's
 * fence window (isw_store_access, isw_store_access_with), never a wait for the network:
 * a revoke waits at most for one memcpy or one nonblocking receive.
 *
 * Before its first request a connection proves the cluster key (isw_auth.h): accepting it
 * queues the HELLO with a fresh nonce, and until the ANSWER arrived and was checked, bytes
 * it sends are only buffered, never parsed as requests.  A wrong or garbled answer gets a
 * refusing VERDICT and the connection is closed; one that closes, or stays silent past the
 * handshake deadline (the worker's epoll_wait wakes for the earliest one), is closed too.
 * Each is counted in auth_refusals, and its reason kept for the daemon's log.
 *
 * Limits on connections nobody has vouched for (isw_dataserver.h): the server holds at most
 * max_connections at once.  One more arriving at the cap makes room by closing the oldest
 * connection of the accepting worker that has not proved the key (proven ones are kept); if
 * that worker has none, the new connection is closed instead.  Either is counted in
 * capacity_closes.  A connection costs its struct and a 128-byte buffer until it proved the
 * key; the 64 KiB receive buffer comes with the proof.  When accept fails for want of
 * descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM) while a connection waits (Linux
 * fails an accept with EMFILE even when none does, once the last descriptor is taken: that
 * is ignored) the worker first closes its oldest unproven connection and tries again; with
 * none, it takes the listener out of its epoll set for ISW_ACCEPT_PAUSE_MS (counted in
 * accept_pauses, errno kept for the daemon's log, which says so at most once a minute) and
 * goes on serving its connections: no spinning, no sleeping on the paging path.
 *
 * READ replies leave from the reply buffer rather than straight from slab memory: that
 * costs a memcpy, but the kernel's copy out of (cold) slab memory measured about twice the
 * memcpy plus the send from a warm buffer (docs/infiniswap.md, "TCP data path").
 */
#include "isw_dataserver.h"
#include "isw_auth.h"
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
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <openssl/crypto.h>

#define ISW_SERVER_WORKERS 2
#define ISW_RX_BUF (64u << 10)          /* a connection's receive buffer */
#define ISW_DIRECT_MIN (16u << 10)      /* WRITE payloads this large go straight into the slab */
#define ISW_TX_MIN (ISW_PROTO_REP_SIZE + ISW_PAGE_SIZE)   /* reply buffer to begin with */
#define ISW_TX_FLUSH (256u << 10)       /* send the replies once this many bytes wait */
#define ISW_EPOLL_EVENTS 64
#define ISW_HS_RX 128u                  /* receive buffer until the key is proven */
#define ISW_HS_TX (ISW_AUTH_HELLO_SIZE + ISW_AUTH_VERDICT_SIZE)   /* reply buffer until then */

enum step { STEP_AGAIN, STEP_WAIT, STEP_CLOSE };

struct worker;

struct conn {
    struct conn *prev, *next;   /* in the worker's list */
    struct worker *w;
    int fd;
    int in_payload;             /* receiving the payload of the WRITE in q */
    int sending;                /* replies wait for the socket (EPOLLOUT, no reading) */
    int close_after_send;       /* the stream cannot be trusted after these replies */
    int authed;                 /* proved the cluster key: requests are served */
    int refused;                /* counted as refused already */
    uint64_t deadline_ms;       /* of the handshake (monotonic) while not authed */
    unsigned char nonce[ISW_AUTH_NONCE_SIZE];   /* the HELLO's */
    struct isw_req q;           /* the WRITE being received */
    int status;                 /* its status so far: 0 or -errno */
    uint64_t done;              /* its payload bytes handled */
    ssize_t io_rc;              /* result of the receive made inside a fence window */
    unsigned char *rx;          /* rx[head, tail): received, not yet consumed */
    size_t head, tail, rx_cap;  /* rx_cap: ISW_HS_RX until authed, then ISW_RX_BUF */
    unsigned char *tx;          /* tx[tx_off, tx_len): replies not sent yet */
    size_t tx_cap, tx_len, tx_off;
};

struct worker {
    struct isw_server *srv;
    int ep;
    pthread_t th;
    struct conn *conns;         /* oldest first */
    struct conn *last;          /* newest */
    int handshakes;             /* connections of conns not authed yet */
    int listening;              /* the listener is in ep (not paused) */
    uint64_t resume_ms;         /* while paused: when to put the listener back (monotonic) */
};

struct isw_server {
    struct isw_store *store;
    int lfd;
    int stop_fd;                /* eventfd: readable once stop() was called */
    int port;
    int nworkers;
    struct worker workers[ISW_SERVER_WORKERS];
    atomic_int stopped;
    _Atomic uint64_t connections, active, requests, reads, writes, bytes_read, bytes_written,
        errors, auth_ok, auth_refused, auth_timeouts, capacity_closes, accept_pauses;
    atomic_int accept_errno;    /* errno of the last accept that paused (positive) */
    uint64_t max_conns;         /* connections held at once at most */
    unsigned char key[ISW_AUTH_KEY_MAX];
    size_t key_len;
    int handshake_ms;
    int rto_min_us;             /* asked for on every accepted connection */
    _Atomic uint64_t rto_min_taken;     /* what the last one took */
    pthread_mutex_t why_mu;
    char last_refusal[200];     /* under why_mu */
};

/* epoll data of the two shared descriptors (connections carry their struct conn). */
static char listen_tag, stop_tag;

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

/* ---------- connections ---------- */

static void conn_close(struct conn *c)
{
    struct worker *w = c->w;

    if (c->prev != NULL)
        c->prev->next = c->next;
    else
        w->conns = c->next;
    if (c->next != NULL)
        c->next->prev = c->prev;
    else
        w->last = c->prev;
    if (!c->authed)
        w->handshakes--;
    close(c->fd);                       /* also removes it from the epoll set */
    free(c->rx);
    free(c->tx);
    free(c);
    atomic_fetch_sub(&w->srv->active, 1);
}

static int conn_watch(struct conn *c, uint32_t events)
{
    struct epoll_event ev = { .events = events, .data.ptr = c };
    return epoll_ctl(c->w->ep, EPOLL_CTL_MOD, c->fd, &ev) < 0 ? -errno : 0;
}

/* Send what the reply buffer holds: STEP_AGAIN once it is all gone, STEP_WAIT while the
 * socket is full (the connection then waits for EPOLLOUT and reads nothing). */
static enum step flush_replies(struct conn *c)
{
    if (c->tx_off < c->tx_len) {
        struct iovec iov = { c->tx + c->tx_off, c->tx_len - c->tx_off };
        ssize_t n = isw_send_some(c->fd, &iov, 1);
        if (n < 0)
            return STEP_CLOSE;
        c->tx_off += (size_t)n;
    }
    if (c->tx_off < c->tx_len) {
        if (!c->sending && conn_watch(c, EPOLLOUT) < 0)
            return STEP_CLOSE;
        c->sending = 1;
        return STEP_WAIT;
    }
    c->tx_off = c->tx_len = 0;
    if (c->sending && conn_watch(c, EPOLLIN) < 0)
        return STEP_CLOSE;
    c->sending = 0;
    return c->close_after_send ? STEP_CLOSE : STEP_AGAIN;
}

/* Room for `len` more bytes of replies (the buffer is not being sent: tx_off == 0). */
static int tx_reserve(struct conn *c, size_t len)
{
    if (c->tx_cap - c->tx_len >= len)
        return 0;
    size_t cap = c->tx_len + len > 2 * c->tx_cap ? c->tx_len + len : 2 * c->tx_cap;
    unsigned char *b = realloc(c->tx, cap);
    if (b == NULL)
        return -ENOMEM;
    c->tx = b;
    c->tx_cap = cap;
    return 0;
}

/* Append the reply to `q` with `status`; a successful READ copies the slab's bytes behind
 * it (inside the slab's fence window).  Sends the replies once ISW_TX_FLUSH bytes wait. */
static enum step add_reply(struct conn *c, const struct isw_req *q, int status)
{
    struct isw_server *srv = c->w->srv;
    size_t plen = status == 0 && q->op == ISW_OP_READ ? q->length : 0;

    if (plen > 0 && tx_reserve(c, ISW_PROTO_REP_SIZE + plen) < 0) {
        status = -ENOMEM;
        plen = 0;
    }
    if (plen == 0 && tx_reserve(c, ISW_PROTO_REP_SIZE) < 0)
        return STEP_CLOSE;
    if (plen > 0) {
        status = isw_store_access(srv->store, q->region_offset, plen, q->gen,
                                  c->tx + c->tx_len + ISW_PROTO_REP_SIZE, 0);
        if (status < 0)
            plen = 0;
    }
    struct isw_rep rep = { .magic = ISW_PROTO_REPLY_MAGIC, .status = status, .req_id = q->req_id };
    isw_rep_encode(&rep, c->tx + c->tx_len);
    c->tx_len += ISW_PROTO_REP_SIZE + plen;
    if (status != 0)
        atomic_fetch_add(&srv->errors, 1);
    else if (plen > 0)
        atomic_fetch_add(&srv->bytes_read, plen);
    return c->tx_len >= ISW_TX_FLUSH ? flush_replies(c) : STEP_AGAIN;
}

/* Receive more bytes into the buffer (moving what is left to its start first). */
static enum step fill_rx(struct conn *c)
{
    if (c->head > 0) {
        memmove(c->rx, c->rx + c->head, c->tail - c->head);
        c->tail -= c->head;
        c->head = 0;
    }
    ssize_t n = isw_recv_some(c->fd, c->rx + c->tail, c->rx_cap - c->tail);
    if (n == -EAGAIN)
        return STEP_WAIT;
    if (n < 0)
        return STEP_CLOSE;
    c->tail += (size_t)n;
    return STEP_AGAIN;
}

/* Take the next request header from the buffer: a READ is answered at once, a WRITE
 * goes on with its payload. */
static enum step take_request(struct conn *c)
{
    struct isw_server *srv = c->w->srv;
    struct isw_req q;
    int fatal;

    isw_req_decode(c->rx + c->head, &q);
    c->head += ISW_PROTO_REQ_SIZE;
    atomic_fetch_add(&srv->requests, 1);
    int status = request_status(&q, &fatal);
    if (fatal) {
        c->close_after_send = 1;
        enum step st = add_reply(c, &q, status);
        return st == STEP_AGAIN ? flush_replies(c) : st;
    }
    if (q.op == ISW_OP_READ) {
        atomic_fetch_add(&srv->reads, 1);
        return add_reply(c, &q, 0);
    }
    atomic_fetch_add(&srv->writes, 1);
    c->q = q;
    c->status = isw_store_check_region(srv->store, q.region_offset, q.length);
    c->done = 0;
    c->in_payload = 1;
    return STEP_AGAIN;
}

/* Inside the slab's fence window: receive WRITE payload straight into slab memory. */
static int recv_into_slab(unsigned char *mem, uint64_t len, void *arg)
{
    struct conn *c = arg;
    c->io_rc = isw_recv_some(c->fd, mem, len);
    return 0;
}

/* Take WRITE payload: from the buffer, or straight from the socket into the slab. */
static enum step take_payload(struct conn *c)
{
    struct isw_server *srv = c->w->srv;
    uint64_t off = c->q.region_offset + c->done;
    size_t left = c->q.length - c->done;
    size_t have = c->tail - c->head;

    if (left == 0) {
        c->in_payload = 0;
        if (c->status == 0)
            atomic_fetch_add(&srv->bytes_written, c->q.length);
        return add_reply(c, &c->q, c->status);
    }
    if (have > 0) {
        size_t n = have < left ? have : left;
        if (c->status == 0)
            c->status = isw_store_access(srv->store, off, n, c->q.gen, c->rx + c->head, 1);
        c->head += n;
        c->done += n;
        return STEP_AGAIN;
    }
    if (c->status != 0 || left < ISW_DIRECT_MIN)
        return fill_rx(c);              /* small, or to be discarded: through the buffer */
    int rc = isw_store_access_with(srv->store, off, left, c->q.gen, recv_into_slab, c);
    if (rc < 0) {
        c->status = rc;                 /* taken back meanwhile: discard the rest */
        return STEP_AGAIN;
    }
    if (c->io_rc == -EAGAIN)
        return STEP_WAIT;
    if (c->io_rc < 0)
        return STEP_CLOSE;
    c->done += (uint64_t)c->io_rc;
    return STEP_AGAIN;
}

/* ---------- the handshake (isw_auth.h) ---------- */

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Count connection c as refused (once) and keep why for the daemon's log. */
static void refuse(struct conn *c, const char *why, int timed_out)
{
    struct isw_server *srv = c->w->srv;

    if (c->refused)
        return;
    c->refused = 1;
    atomic_fetch_add(&srv->auth_refused, 1);
    if (timed_out)
        atomic_fetch_add(&srv->auth_timeouts, 1);
    pthread_mutex_lock(&srv->why_mu);
    snprintf(srv->last_refusal, sizeof srv->last_refusal, "%s", why);
    pthread_mutex_unlock(&srv->why_mu);
}

/* The client's ANSWER is in the buffer: check it and queue the VERDICT.  A refused
 * connection is closed once the verdict is sent. */
static enum step take_answer(struct conn *c)
{
    struct isw_server *srv = c->w->srv;
    char why[160];

    if (tx_reserve(c, ISW_AUTH_VERDICT_SIZE) < 0)
        return STEP_CLOSE;
    int rc = isw_auth_server_check(srv->key, srv->key_len, c->nonce, c->rx + c->head,
                                   c->tx + c->tx_len, why, sizeof why);
    c->head += ISW_AUTH_ANSWER_SIZE;
    c->tx_len += ISW_AUTH_VERDICT_SIZE;
    if (rc < 0) {
        refuse(c, why, 0);
        c->close_after_send = 1;
        return flush_replies(c);
    }
    unsigned char *rx = realloc(c->rx, ISW_RX_BUF);    /* served from now on */
    if (rx == NULL) {
        refuse(c, "out of memory for the receive buffer of a proven connection", 0);
        return STEP_CLOSE;
    }
    c->rx = rx;
    c->rx_cap = ISW_RX_BUF;
    c->authed = 1;
    c->w->handshakes--;
    atomic_fetch_add(&srv->auth_ok, 1);
    return STEP_AGAIN;
}

/* Close every connection of w whose handshake is past its deadline; the milliseconds to
 * the next deadline (-1: none). */
static int expire_handshakes(struct worker *w)
{
    uint64_t now = now_ms(), next = UINT64_MAX;
    struct conn *c = w->conns;

    if (w->handshakes == 0)
        return -1;
    while (c != NULL) {
        struct conn *nx = c->next;
        if (!c->authed) {
            if (now >= c->deadline_ms) {
                refuse(c, "no handshake answer before the deadline", 1);
                conn_close(c);
            } else if (c->deadline_ms < next) {
                next = c->deadline_ms;
            }
        }
        c = nx;
    }
    return next == UINT64_MAX ? -1 : (int)(next - now);
}

/* One turn of a connection the epoll set reported ready (see the top of the file).  A
 * receive is made when the turn begins and whenever a request in progress needs more
 * bytes; once a request was served, the turn ends when the buffer holds no complete
 * header (a device that pipelines nothing would make that receive find nothing; the
 * level-triggered epoll set reports the connection again when there is more).  So a turn
 * serves at most one buffer of requests, plus the rest of the payload of the last one. */
static void conn_ready(struct conn *c)
{
    enum step st = STEP_AGAIN;
    int served = 0, received = 0;

    if (c->sending) {
        st = flush_replies(c);
        if (st != STEP_AGAIN)
            goto end;
    }
    for (;;) {
        if (!c->authed) {               /* nothing is served before the proof */
            if (c->tail - c->head >= ISW_AUTH_ANSWER_SIZE) {
                st = take_answer(c);
            } else {
                st = fill_rx(c);
                received = 1;
            }
        } else if (c->in_payload) {
            st = take_payload(c);
            served += !c->in_payload;
        } else if (c->tail - c->head >= ISW_PROTO_REQ_SIZE) {
            st = take_request(c);
            served += !c->in_payload;
        } else if (served > 0 && received) {
            break;
        } else {
            st = fill_rx(c);
            received = 1;
        }
        if (st != STEP_AGAIN)
            break;
    }
    if (st != STEP_CLOSE && !c->sending)
        st = flush_replies(c);
end:
    if (st == STEP_CLOSE) {
        if (!c->authed)
            refuse(c, "the peer closed the connection (or broke it) before the handshake "
                   "ended", 0);
        conn_close(c);
    }
}

/* ---------- workers ---------- */

/* Close w's oldest connection that has not proved the key (counted in capacity_closes,
 * refused with `why`): 1, or 0 when w has none. */
static int make_room(struct worker *w, const char *why)
{
    if (w->handshakes == 0)
        return 0;
    for (struct conn *c = w->conns; c != NULL; c = c->next) {
        if (!c->authed) {
            refuse(c, why, 0);
            atomic_fetch_add(&w->srv->capacity_closes, 1);
            conn_close(c);
            return 1;
        }
    }
    return 0;
}

/* Whether a connection waits in the listener's queue (poll needs no new descriptor). */
static int listener_pending(int lfd)
{
    struct pollfd pfd = { .fd = lfd, .events = POLLIN };
    return poll(&pfd, 1, 0) > 0 && (pfd.revents & POLLIN) != 0;
}

/* accept failed with err (positive) for want of resources: take the listener out of w's
 * epoll set for ISW_ACCEPT_PAUSE_MS (worker_main puts it back), so the worker serves its
 * connections meanwhile instead of spinning on a listener that stays readable. */
static void pause_accept(struct worker *w, int err)
{
    struct isw_server *srv = w->srv;

    atomic_fetch_add(&srv->accept_pauses, 1);
    atomic_store(&srv->accept_errno, err);
    w->resume_ms = now_ms() + ISW_ACCEPT_PAUSE_MS;
    if (w->listening && epoll_ctl(w->ep, EPOLL_CTL_DEL, srv->lfd, NULL) == 0) {
        w->listening = 0;
        return;
    }
    if (w->listening) {                 /* cannot happen with a valid set; never spin */
        atomic_store(&srv->accept_errno, errno);
        isw_sleep_us(ISW_ACCEPT_PAUSE_MS * 1000u);
    }
}

/* Put the listener back into w's epoll set once its pause is over; the milliseconds until
 * then (-1: not paused). */
static int resume_accept(struct worker *w)
{
    struct isw_server *srv = w->srv;

    if (w->listening)
        return -1;
    uint64_t now = now_ms();
    if (now < w->resume_ms)
        return (int)(w->resume_ms - now);
    struct epoll_event lev = { .events = EPOLLIN | EPOLLEXCLUSIVE, .data.ptr = &listen_tag };
    if (epoll_ctl(w->ep, EPOLL_CTL_ADD, srv->lfd, &lev) < 0) {
        atomic_store(&srv->accept_errno, errno);
        atomic_fetch_add(&srv->accept_pauses, 1);
        w->resume_ms = now + ISW_ACCEPT_PAUSE_MS;
        return ISW_ACCEPT_PAUSE_MS;
    }
    w->listening = 1;
    return -1;
}

/* The earlier of two epoll timeouts (-1: none). */
static int earliest(int a, int b)
{
    if (a < 0)
        return b;
    if (b < 0)
        return a;
    return a < b ? a : b;
}

/* A new connection on fd, its slot in srv->active already taken by the caller: 0, or -errno
 * (fd closed, the slot given back) when there is no memory for it. */
static int conn_open(struct worker *w, int fd)
{
    struct isw_server *srv = w->srv;
    int one = 1;

    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);    /* best effort */
    atomic_store(&srv->rto_min_taken, (uint64_t)isw_tcp_set_rto_min(fd, srv->rto_min_us));
    struct conn *c = calloc(1, sizeof *c);
    unsigned char *rx = malloc(ISW_HS_RX), *tx = malloc(ISW_HS_TX);
    struct epoll_event ev = { .events = EPOLLIN, .data.ptr = c };
    if (c == NULL || rx == NULL || tx == NULL || epoll_ctl(w->ep, EPOLL_CTL_ADD, fd, &ev) < 0) {
        int err = c == NULL || rx == NULL || tx == NULL ? ENOMEM : errno;
        free(c);
        free(rx);
        free(tx);
        close(fd);
        atomic_fetch_sub(&srv->active, 1);
        return -err;
    }
    c->w = w;
    c->fd = fd;
    c->rx = rx;
    c->rx_cap = ISW_HS_RX;
    c->tx = tx;
    c->tx_cap = ISW_HS_TX;
    c->prev = w->last;                  /* the newest last: conns is oldest first */
    if (w->last != NULL)
        w->last->next = c;
    else
        w->conns = c;
    w->last = c;
    w->handshakes++;
    c->deadline_ms = now_ms() + (uint64_t)srv->handshake_ms;
    atomic_fetch_add(&srv->connections, 1);
    if (isw_auth_nonce(c->nonce) < 0) {
        refuse(c, "no nonce could be made for the handshake", 0);
        conn_close(c);
        return 0;
    }
    isw_auth_hello(c->nonce, c->tx);
    c->tx_len = ISW_AUTH_HELLO_SIZE;
    if (flush_replies(c) == STEP_CLOSE) {
        refuse(c, "the peer broke the connection before the handshake", 0);
        conn_close(c);
    }
    return 0;
}

static void accept_some(struct worker *w)
{
    struct isw_server *srv = w->srv;

    while (w->listening) {
        int fd = accept4(srv->lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
            int err = errno;
            if (err == EINTR || err == ECONNABORTED || err == EPROTO)
                continue;               /* that connection is gone; the next one */
            if (err == EAGAIN || err == EWOULDBLOCK)
                return;                 /* another worker took it, or none left */
            if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
                /* Linux takes the descriptor before it looks at the queue: with the last
                 * one just used, accept fails so with nobody waiting.  Then there is
                 * nothing to make room for (the set reports the next arrival). */
                if (!listener_pending(srv->lfd))
                    return;
                if (make_room(w, "closed to make room: the server is out of descriptors"))
                    continue;
            }
            pause_accept(w, err);       /* out of resources (or worse): back off */
            return;
        }
        /* take a slot first (both workers accept): past the cap, one held here makes room */
        if (atomic_fetch_add(&srv->active, 1) >= srv->max_conns &&
            !make_room(w, "closed to make room: the server is at its connection cap")) {
            atomic_fetch_sub(&srv->active, 1);
            atomic_fetch_add(&srv->capacity_closes, 1);     /* none to spare here: refuse */
            atomic_fetch_add(&srv->connections, 1);
            atomic_fetch_add(&srv->auth_refused, 1);
            pthread_mutex_lock(&srv->why_mu);
            snprintf(srv->last_refusal, sizeof srv->last_refusal,
                     "refused at the connection cap (%llu held)",
                     (unsigned long long)atomic_load(&srv->active));
            pthread_mutex_unlock(&srv->why_mu);
            close(fd);
            continue;
        }
        int rc = conn_open(w, fd);
        if (rc < 0) {
            pause_accept(w, -rc);
            return;
        }
    }
}

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    struct epoll_event evs[ISW_EPOLL_EVENTS];

    for (;;) {
        int timeout = earliest(expire_handshakes(w), resume_accept(w));
        int n = epoll_wait(w->ep, evs, ISW_EPOLL_EVENTS, timeout);
        if (n < 0) {
            if (errno != EINTR)
                isw_sleep_us(10000);
            continue;
        }
        int listener = 0;
        for (int i = 0; i < n; i++) {
            void *tag = evs[i].data.ptr;
            if (tag == &stop_tag)
                goto out;
            listener |= tag == &listen_tag;
        }
        /* Connections first: each appears once per epoll_wait and only its own turn closes
         * it.  The listener last, since making room closes other connections, which must
         * not be named by an event still to be handled. */
        for (int i = 0; i < n; i++) {
            void *tag = evs[i].data.ptr;
            if (tag != &listen_tag)
                conn_ready(tag);
        }
        if (listener)
            accept_some(w);
    }
out:
    while (w->conns != NULL)
        conn_close(w->conns);
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
        int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
                        ai->ai_protocol);
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

/* Stop the first `n` workers and free the server's descriptors (not the struct). */
static void shut_down(struct isw_server *srv, int n)
{
    uint64_t one = 1;
    ssize_t wr = write(srv->stop_fd, &one, sizeof one);
    (void)wr;                           /* an eventfd write of 1 cannot fail here */
    for (int i = 0; i < n; i++)
        pthread_join(srv->workers[i].th, NULL);
    for (int i = 0; i < srv->nworkers; i++)
        if (srv->workers[i].ep >= 0)
            close(srv->workers[i].ep);
    close(srv->lfd);
    close(srv->stop_fd);
}

/* Wipe the key and free the struct. */
static void server_forget(struct isw_server *srv)
{
    OPENSSL_cleanse(srv->key, sizeof srv->key);
    pthread_mutex_destroy(&srv->why_mu);
    free(srv);
}

static int worker_init(struct isw_server *srv, struct worker *w)
{
    struct epoll_event lev = { .events = EPOLLIN | EPOLLEXCLUSIVE, .data.ptr = &listen_tag };
    struct epoll_event sev = { .events = EPOLLIN, .data.ptr = &stop_tag };

    w->srv = srv;
    w->ep = epoll_create1(EPOLL_CLOEXEC);
    if (w->ep < 0)
        return -errno;
    if (epoll_ctl(w->ep, EPOLL_CTL_ADD, srv->lfd, &lev) < 0 ||
        epoll_ctl(w->ep, EPOLL_CTL_ADD, srv->stop_fd, &sev) < 0)
        return -errno;
    w->listening = 1;
    return 0;
}

int isw_server_start(struct isw_store *store, const char *host, int port,
                     const unsigned char *key, size_t key_len, int handshake_timeout_ms,
                     int rto_min_us, int max_connections, struct isw_server **out)
{
    int rc, started = 0;

    if (port < 0 || port > 65535)
        return isw_fail(EINVAL, "port %d is not a TCP port (0..65535)", port);
    if (isw_auth_check_key(key, key_len) < 0)
        return -EINVAL;
    if (handshake_timeout_ms < 0)
        return isw_fail(EINVAL, "the handshake timeout must be >= 0 ms, got %d",
                        handshake_timeout_ms);
    if (max_connections < 0 || max_connections > ISW_SERVER_MAX_CONNECTIONS)
        return isw_fail(EINVAL, "the connection cap must be 0..%d, got %d",
                        ISW_SERVER_MAX_CONNECTIONS, max_connections);
    if (rto_min_us < 0 || rto_min_us > ISW_RTO_MIN_MAX_US)
        return isw_fail(EINVAL, "the retransmission-timeout floor must be 0..%d us, got %d",
                        ISW_RTO_MIN_MAX_US, rto_min_us);
    if (isw_store_fd(store) < 0)
        return isw_fail(EBADF, "the slab store is closed");
    struct isw_server *srv = calloc(1, sizeof *srv);
    if (srv == NULL)
        return isw_fail(ENOMEM, "out of memory");
    srv->store = store;
    memcpy(srv->key, key, key_len);
    srv->key_len = key_len;
    srv->handshake_ms = handshake_timeout_ms > 0 ? handshake_timeout_ms : ISW_AUTH_TIMEOUT_MS;
    srv->rto_min_us = rto_min_us;
    srv->max_conns = max_connections > 0 ? (uint64_t)max_connections
                                          : (uint64_t)ISW_SERVER_DEFAULT_CONNECTIONS;
    pthread_mutex_init(&srv->why_mu, NULL);
    rc = listen_on(host, port, &srv->lfd, &srv->port);
    if (rc < 0) {
        server_forget(srv);
        return rc;
    }
    srv->stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (srv->stop_fd < 0) {
        rc = -errno;
        close(srv->lfd);
        server_forget(srv);
        return isw_fail(-rc, "cannot create an eventfd: %s", isw_strerror(rc));
    }
    srv->nworkers = ISW_SERVER_WORKERS;
    for (int i = 0; i < srv->nworkers; i++)
        srv->workers[i].ep = -1;
    isw_store_acquire(store);
    for (int i = 0; i < srv->nworkers && rc == 0; i++) {
        rc = worker_init(srv, &srv->workers[i]);
        if (rc == 0)
            rc = isw_thread_start(&srv->workers[i].th, worker_main, &srv->workers[i]);
        if (rc == 0)
            started++;
    }
    if (rc < 0) {
        shut_down(srv, started);
        isw_store_release(store);
        server_forget(srv);
        return isw_fail(-rc, "cannot start the data server's workers: %s", isw_strerror(rc));
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
    shut_down(srv, srv->nworkers);      /* each worker closes its connections */
    isw_store_release(srv->store);      /* no thread touches the store any more */
    return 0;
}

void isw_server_free(struct isw_server *srv)
{
    if (srv == NULL)
        return;
    isw_server_stop(srv);
    server_forget(srv);
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
    out->auth_successes = atomic_load(&srv->auth_ok);
    out->auth_refusals = atomic_load(&srv->auth_refused);
    out->auth_timeouts = atomic_load(&srv->auth_timeouts);
    out->rto_min_us = atomic_load(&srv->rto_min_taken);
    out->capacity_closes = atomic_load(&srv->capacity_closes);
    out->accept_pauses = atomic_load(&srv->accept_pauses);
    out->accept_errno = (uint64_t)atomic_load(&srv->accept_errno);
    out->max_connections = srv->max_conns;
    return 0;
}

int isw_server_last_refusal(struct isw_server *srv, char *out, size_t n)
{
    if (n == 0)
        return isw_fail(EINVAL, "no room for the message");
    pthread_mutex_lock(&srv->why_mu);
    snprintf(out, n, "%s", srv->last_refusal);
    pthread_mutex_unlock(&srv->why_mu);
    return 0;
}
