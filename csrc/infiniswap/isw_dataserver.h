/*
 * isw_dataserver.h — the daemon's TCP data server: serves READ/WRITE of store regions to
 * devices on other hosts (wire format in isw_proto.h).  Two event-loop threads (epoll) serve
 * every connection, with pipelined requests answered in batches; a misbehaving client only
 * loses its own connection, and a client that does not read its replies holds up no other.
 * A connection is served only after it proved the cluster key (isw_auth.h); a peer that
 * does not (wrong key, garbled, truncated or replayed answer, or silence past the handshake
 * deadline) is closed and counted in auth_refusals.
 *
 * Limits: at most max_connections connections at once; at the cap a new one makes room by
 * closing the oldest connection (of the worker that accepts it) that has not proved the key,
 * and is closed itself when there is none (capacity_closes); proven connections are never
 * closed to make room.  An accept that fails for want of descriptors or memory while a
 * connection waits closes the oldest unproven connection to make room, else pauses accepting
 * for ISW_ACCEPT_PAUSE_MS (accept_pauses, accept_errno) while the connections are served; one
 * that fails so with nobody waiting (Linux takes the descriptor first) is ignored.  Both
 * workers accept: a connection takes its slot under the cap before it is opened.
 */
#ifndef ISW_DATASERVER_H
#define ISW_DATASERVER_H

#include <stddef.h>
#include <stdint.h>

/* cffi:begin */
/* The most a connection's retransmission-timeout floor takes: the kernel's own (200 ms). */
#define ISW_RTO_MIN_MAX_US 200000
/* Connections a server holds at once: the most one can be given, and its default. */
#define ISW_SERVER_MAX_CONNECTIONS 1048576
#define ISW_SERVER_DEFAULT_CONNECTIONS 512
/* How long a worker stops accepting after accept failed for want of resources (ms). */
#define ISW_ACCEPT_PAUSE_MS 500

struct isw_store;
struct isw_server;

struct isw_server_stats {
    uint64_t connections;           /* accepted so far */
    uint64_t active_connections;
    uint64_t requests;
    uint64_t read_requests, write_requests;
    uint64_t bytes_read;            /* sent to clients */
    uint64_t bytes_written;         /* received into the store */
    uint64_t errors;                /* requests answered with an error */
    uint64_t auth_successes;        /* connections that proved the cluster key */
    uint64_t auth_refusals;         /* connections closed before proving it (all reasons) */
    uint64_t auth_timeouts;         /* of which: silent past the handshake deadline */
    uint64_t rto_min_us;            /* retransmission-timeout floor of the last connection
                                       accepted (us); 0: the kernel's (200 ms) */
    uint64_t capacity_closes;       /* unproven connections closed to make room, or refused
                                       at the cap (also counted in auth_refusals) */
    uint64_t accept_pauses;         /* times accepting paused for want of resources */
    uint64_t accept_errno;          /* errno of the last such accept failure (0: none) */
    uint64_t max_connections;       /* the cap in effect */
};

/* Bind host:port (port 0: the OS picks) and start serving connections that prove the
 * cluster key `key` (ISW_AUTH_KEY_MIN..MAX bytes, copied) within `handshake_timeout_ms`
 * (0: ISW_AUTH_TIMEOUT_MS), holding at most `max_connections` at once (1..
 * ISW_SERVER_MAX_CONNECTIONS; 0: ISW_SERVER_DEFAULT_CONNECTIONS).  Every accepted connection asks for a retransmission-timeout
 * floor of `rto_min_us` (0..ISW_RTO_MIN_MAX_US; 0: the kernel's), so a reply whose last
 * segments are lost is sent again after about a round trip, not 200 ms.  The store stays
 * alive (and cannot be closed) until the server is stopped. */
int isw_server_start(struct isw_store *store, const char *host, int port,
                     const unsigned char *key, size_t key_len, int handshake_timeout_ms,
                     int rto_min_us, int max_connections, struct isw_server **out);
int isw_server_port(struct isw_server *srv);
/* Close the listener and every connection, join all threads, release the store.
 * Idempotent. */
int isw_server_stop(struct isw_server *srv);
/* Stop (if needed) and free. */
void isw_server_free(struct isw_server *srv);
int isw_server_get_stats(struct isw_server *srv, struct isw_server_stats *out);
/* Why the last refused connection was refused ("" if none), into out[n]. */
int isw_server_last_refusal(struct isw_server *srv, char *out, size_t n);
/* cffi:end */

#endif
