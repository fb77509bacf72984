/*
 * isw_net.h — TCP helpers shared by the data-server client and server.
 * The blocking ones return 0 or -errno; a socket timeout (SO_RCVTIMEO/SO_SNDTIMEO) becomes
 * -ETIMEDOUT and an orderly close by the peer becomes -ECONNRESET.  No function raises SIGPIPE.
 */
#ifndef ISW_NET_H
#define ISW_NET_H

#include <stddef.h>
#include <sys/types.h>
#include <sys/uio.h>

int isw_send_all(int fd, const struct iovec *iov, int iovcnt);
int isw_recv_all(int fd, void *buf, size_t len);
/* One nonblocking sendmsg: bytes sent (0 when the send buffer is full) or -errno. */
ssize_t isw_send_some(int fd, const struct iovec *iov, int iovcnt);
/* One nonblocking recv: bytes received, -EAGAIN when none are there, -ECONNRESET at an orderly
 * close by the peer, or -errno. */
ssize_t isw_recv_some(int fd, void *buf, size_t len);
int isw_set_timeouts(int fd, int timeout_ms);
/* Connect with a timeout; sets TCP_NODELAY and the send/receive timeouts.  Sets the
 * thread's error message on failure. */
int isw_tcp_connect(const char *host, int port, int timeout_ms, int *out_fd);

#endif
