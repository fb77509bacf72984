/*
 * isw_net.h — TCP helpers shared by the data-server client and server.
 * The blocking ones return 0 or -errno; a socket timeout (SO_RCVTIMEO/SO_SNDTIMEO) becomes
 * -ETIMEDOUT and an orderly close by the peer becomes -ECONNRESET.  No function raises SIGPIPE.
 */
#ifndef ISW_NET_H
#define ISW_NET_H

#include "isw_dataserver.h"     /* ISW_RTO_MIN_MAX_US */

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
/* Lower the socket's retransmission-timeout floor (TCP_RTO_MIN_US, Linux 6.15+) to `us`
 * microseconds, or as little above it as the kernel's clock ticks allow (at most
 * ISW_RTO_MIN_MAX_US, the kernel's own floor).  Returns the floor in effect, or 0 where `us`
 * is 0 or the kernel has no such option (the kernel's 200 ms floor stays). */
int isw_tcp_set_rto_min(int fd, int us);
/* The socket's retransmission-timeout floor (us) when lowered below the kernel's, else 0. */
int isw_tcp_rto_min(int fd);
/* Connect with a timeout; sets TCP_NODELAY, the send/receive timeouts and the
 * retransmission-timeout floor (`rto_min_us`, 0: the kernel's).  Sets the thread's error
 * message on failure. */
int isw_tcp_connect(const char *host, int port, int timeout_ms, int rto_min_us, int *out_fd);

#endif
