/*
 * isw_dataserver.h — the daemon's TCP data server: serves READ/WRITE of store regions to
 * devices on other hosts (wire format in isw_proto.h).  Two event-loop threads (epoll) serve
 * every connection, with pipelined requests answered in batches; a misbehaving client only
 * loses its own connection, and a client that does not read its replies holds up no other.
 * A connection is served only after it proved the cluster key (isw_auth.h); a peer that
 * does not (wrong key, garbled, truncated or replayed answer, or silence past the handshake
 * deadline) is closed and counted in auth_refusals.
 */
#ifndef ISW_DATASERVER_H
#define ISW_DATASERVER_H

#include <stddef.h>
#include <stdint.h>

/* cffi:begin */
/* The most a connection's retransmission-timeout floor takes: the kernel's own (200 ms). */
#define ISW_RTO_MIN_MAX_US 200000

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
};

/* Bind host:port (port 0: the OS picks) and start serving connections that prove the
 * cluster key `key` (ISW_AUTH_KEY_MIN..MAX bytes, copied) within `handshake_timeout_ms`
 * (0: ISW_AUTH_TIMEOUT_MS).  Every accepted connection asks for a retransmission-timeout
 * floor of `rto_min_us` (0..ISW_RTO_MIN_MAX_US; 0: the kernel's), so a reply whose last
 * segments are lost is sent again after about a round trip, not 200 ms.  The store stays
 * alive (and cannot be closed) until the server is stopped. */
int isw_server_start(struct isw_store *store, const char *host, int port,
                     const unsigned char *key, size_t key_len, int handshake_timeout_ms,
                     int rto_min_us, struct isw_server **out);
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
