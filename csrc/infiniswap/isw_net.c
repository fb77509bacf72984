/*
 * isw_net.c — TCP helpers: blocking whole-buffer send/receive (the device side), one
 * nonblocking send/receive (the data server's event loop), timeouts, the retransmission-
 * timeout floor, connect with a deadline.  Used by isw_tcp_client.c and isw_dataserver.c.
 *
 * Owns: nothing; the caller owns every socket (isw_tcp_connect hands its new one over).
 */
#include "isw_net.h"
#include "isw_common.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#define ISW_MAX_IOV 4

#ifndef TCP_RTO_MIN_US
#define TCP_RTO_MIN_US 45       /* linux/tcp.h, Linux 6.15+ */
#endif

static int io_errno(int e)
{
    return (e == EAGAIN || e == EWOULDBLOCK) ? -ETIMEDOUT : -e;
}

int isw_send_all(int fd, const struct iovec *iov_in, int iovcnt)
{
    struct iovec iov[ISW_MAX_IOV];
    struct msghdr msg;
    int first = 0;

    if (iovcnt > ISW_MAX_IOV)
        return -EINVAL;
    memcpy(iov, iov_in, sizeof(struct iovec) * (size_t)iovcnt);
    while (first < iovcnt) {
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov + first;
        msg.msg_iovlen = (size_t)(iovcnt - first);
        ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return io_errno(errno);
        }
        size_t left = (size_t)n;
        while (first < iovcnt && left >= iov[first].iov_len) {
            left -= iov[first].iov_len;
            first++;
        }
        if (first < iovcnt) {
            iov[first].iov_base = (char *)iov[first].iov_base + left;
            iov[first].iov_len -= left;
        }
    }
    return 0;
}

int isw_recv_all(int fd, void *buf, size_t len)
{
    unsigned char *p = buf;

    while (len > 0) {
        ssize_t n = recv(fd, p, len, 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return io_errno(errno);
        }
        if (n == 0)
            return -ECONNRESET;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

ssize_t isw_send_some(int fd, const struct iovec *iov, int iovcnt)
{
    struct msghdr msg;

    memset(&msg, 0, sizeof msg);
    msg.msg_iov = (struct iovec *)iov;
    msg.msg_iovlen = (size_t)iovcnt;
    for (;;) {
        ssize_t n = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n >= 0)
            return n;
        if (errno == EINTR)
            continue;
        return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -errno;
    }
}

ssize_t isw_recv_some(int fd, void *buf, size_t len)
{
    for (;;) {
        ssize_t n = recv(fd, buf, len, MSG_DONTWAIT);
        if (n > 0)
            return n;
        if (n == 0)
            return -ECONNRESET;
        if (errno == EINTR)
            continue;
        return errno == EWOULDBLOCK ? -EAGAIN : -errno;
    }
}

int isw_set_timeouts(int fd, int timeout_ms)
{
    struct timeval tv = { .tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000 };

    if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) < 0 ||
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) < 0)
        return -errno;
    return 0;
}

int isw_tcp_set_rto_min(int fd, int us)
{
    int ask = us;

    if (us <= 0)
        return 0;
    if (ask > ISW_RTO_MIN_MAX_US)
        ask = ISW_RTO_MIN_MAX_US;
    /* The kernel takes whole clock ticks, at least two: below that it answers EINVAL, so the
     * request doubles until it is taken.  ENOPROTOOPT: a kernel before 6.15. */
    while (setsockopt(fd, IPPROTO_TCP, TCP_RTO_MIN_US, &ask, sizeof ask) < 0) {
        if (errno != EINVAL || ask >= ISW_RTO_MIN_MAX_US)
            return 0;
        ask = ask > ISW_RTO_MIN_MAX_US / 2 ? ISW_RTO_MIN_MAX_US : 2 * ask;
    }
    return isw_tcp_rto_min(fd);
}

int isw_tcp_rto_min(int fd)
{
    int got = 0;
    socklen_t sl = sizeof got;

    if (getsockopt(fd, IPPROTO_TCP, TCP_RTO_MIN_US, &got, &sl) < 0 || got >= ISW_RTO_MIN_MAX_US)
        return 0;
    return got;
}

static int connect_one(const struct addrinfo *ai, int timeout_ms, int rto_min_us, int *out_fd)
{
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    int one = 1, rc;

    if (fd < 0)
        return -errno;
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) < 0) {
        if (errno != EINPROGRESS) {
            rc = -errno;
            goto fail;
        }
        struct pollfd pfd = { .fd = fd, .events = POLLOUT };
        int pr;
        do
            pr = poll(&pfd, 1, timeout_ms);
        while (pr < 0 && errno == EINTR);
        if (pr < 0) {
            rc = -errno;
            goto fail;
        }
        if (pr == 0) {
            rc = -ETIMEDOUT;
            goto fail;
        }
        int soerr = 0;
        socklen_t sl = sizeof soerr;
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) < 0) {
            rc = -errno;
            goto fail;
        }
        if (soerr != 0) {
            rc = -soerr;
            goto fail;
        }
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) < 0) {
        rc = -errno;
        goto fail;
    }
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    isw_tcp_set_rto_min(fd, rto_min_us);
    rc = isw_set_timeouts(fd, timeout_ms);
    if (rc < 0)
        goto fail;
    *out_fd = fd;
    return 0;
fail:
    close(fd);
    return rc;
}

int isw_tcp_connect(const char *host, int port, int timeout_ms, int rto_min_us, int *out_fd)
{
    struct addrinfo hints, *res = NULL;
    char portstr[16];
    int rc = -EHOSTUNREACH;

    if (port <= 0 || port > 65535)
        return isw_fail(EINVAL, "port %d is not a TCP port (1..65535)", port);
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    snprintf(portstr, sizeof portstr, "%d", port);
    int gai = getaddrinfo(host, portstr, &hints, &res);
    if (gai != 0)
        return isw_fail(EHOSTUNREACH, "cannot resolve host '%s': %s", host, gai_strerror(gai));
    for (struct addrinfo *ai = res; ai != NULL; ai = ai->ai_next) {
        rc = connect_one(ai, timeout_ms, rto_min_us, out_fd);
        if (rc == 0)
            break;
    }
    freeaddrinfo(res);
    if (rc < 0)
        return isw_fail(-rc, "connect to %s:%d failed: %s", host, port, isw_strerror(rc));
    return 0;
}
